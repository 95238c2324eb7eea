"""Our engine config -> torchtitan's ``JobConfig``, which the train spec's builders read."""

from torchtitan.config import JobConfig

from forge.engines.titan.config import TitanEngineConfig

# A "constant" schedule is torchtitan's warmup-stable-decay with no decay phase (decay_ratio=0)
# and a length that no run reaches (past its length torchtitan's schedule would divide by zero).
_NEVER_ENDING_STEPS = 2**62


def build_job_config(config: TitanEngineConfig) -> JobConfig:
    job = JobConfig()

    job.model.name = config.model.name
    job.model.flavor = config.model.flavor

    opt = config.optimizer
    job.optimizer.name = opt.name
    job.optimizer.lr = opt.lr
    job.optimizer.beta1, job.optimizer.beta2 = opt.betas
    job.optimizer.eps = opt.eps
    job.optimizer.weight_decay = opt.weight_decay
    job.optimizer.implementation = opt.implementation

    sched = config.lr_scheduler
    job.lr_scheduler.warmup_steps = sched.warmup_steps
    job.lr_scheduler.min_lr_factor = sched.min_lr_factor
    if sched.decay_type == "constant":
        job.lr_scheduler.decay_ratio = 0.0
        job.lr_scheduler.total_steps = _NEVER_ENDING_STEPS
    else:
        job.lr_scheduler.decay_type = sched.decay_type
        job.lr_scheduler.total_steps = sched.total_steps
    job.training.steps = job.lr_scheduler.total_steps

    train = config.training
    job.training.seq_len = train.seq_len
    job.training.max_norm = train.max_norm
    job.training.dtype = train.dtype
    job.training.mixed_precision_param = train.mixed_precision_param
    job.debug.seed = train.seed
    job.compile.enable = train.compile
    job.compile.components = ["model"]
    job.activation_checkpoint.mode = train.activation_checkpoint

    par = config.parallelism
    job.parallelism.data_parallel_shard_degree = par.data_parallel_shard_degree
    job.parallelism.data_parallel_replicate_degree = par.data_parallel_replicate_degree
    job.parallelism.tensor_parallel_degree = par.tensor_parallel_degree
    job.parallelism.fsdp_reshard_after_forward = par.fsdp_reshard_after_forward
    # Loss functions are ours and take plain logits, not vocab-sharded DTensors.
    job.parallelism.disable_loss_parallel = True
    return job
