"""The SFT app end to end: real trainer processes, the tiny TorchTitan model, real files.

Runs are shortened versions of configs/sft/tiny_cpu.yaml (the shipped config, so that it is
checked too). The chat loss mask is tested token by token in tests/sft/test_dataset.py.
"""

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from apps.sft.main import main
from hf_checkpoints import make_checkpoint
from transformers import AutoModelForCausalLM, AutoTokenizer

from forge.config import load_config
from forge.data.tokenizer import embedded_tokenizer
from forge.engines.titan.config import ModelConfig
from forge.engines.titan.engine import TitanEngine
from forge.runs.checkpoint import RunCheckpointer
from forge.sft.config import SFTConfig

pytestmark = pytest.mark.slow

TINY_CPU = Path(__file__).resolve().parents[2] / "configs" / "sft" / "tiny_cpu.yaml"
STEPS = 8
# A short run of the embedded task, with an LR that changes at every step so that a resume
# that lost the scheduler's state could not match.
SHORT = [
    "--config",
    str(TINY_CPU),
    "trainer.threads=1",
    "data.embedded_task.num_train=256",
    "data.embedded_task.num_eval=32",
    "data.batch_size=16",
    "log_every=1",
    "eval_every=4",
    "trainer.engine.lr_scheduler.warmup_steps=2",
    "trainer.engine.lr_scheduler.decay_type=linear",
    f"trainer.engine.lr_scheduler.total_steps={STEPS}",
    "generation_eval.num_prompts=16",
]


def warm_start_overrides(grpo_config: str) -> list[str]:
    """The overrides a shipped GRPO config gives the SFT run of its warm start (on a fresh
    machine that run has no checkpoint yet: they must start it, not refuse)."""
    shipped = yaml.safe_load((TINY_CPU.parents[1] / "grpo" / grpo_config).read_text())
    return shipped["warm_start"]["sft_overrides"]


def run_app(run_dir: Path, *overrides: str) -> tuple[list[dict], str]:
    """Runs the app in this process; returns its metrics rows and what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main([*SHORT, f"run_dir={run_dir}", *overrides])
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return rows, out.getvalue()


def by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {row["step"]: row[key] for row in rows if key in row}


@pytest.fixture(scope="module", autouse=True)
def _restore_process_state():
    """main() sets OMP_NUM_THREADS for its trainer processes: it may not leak into other test
    modules (the process group the export test creates is dropped by tests/conftest.py)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("straight")
    # Started as `make grpo` starts its warm start.
    warm_start = warm_start_overrides("tiny_cpu.yaml")
    rows, printed = run_app(run_dir, f"max_steps={STEPS}", "checkpoint.every=4", *warm_start)
    return run_dir, rows, printed


def test_tiny_run_learns_reports_and_exports(straight_run):
    run_dir, rows, printed = straight_run
    loss = by_step(rows, "train/loss")
    eval_accuracy = by_step(rows, "eval/token_accuracy")
    assert sorted(loss) == list(range(1, STEPS + 1))
    assert loss[STEPS] < 0.7 * loss[1]
    assert sorted(eval_accuracy) == [0, 4, STEPS] and eval_accuracy[STEPS] > eval_accuracy[0] + 0.1
    step_row = next(row for row in rows if row["step"] == 1)
    for key in ("sft/token_accuracy", "sft/loss", "train/tokens_per_s", "train/lr", "data/epoch"):
        assert key in step_row, key
    assert {"data/train_truncated", "data/train_dropped", "eval/loss", "eval/perplexity"} <= rows[0].keys()
    assert 0.0 <= by_step(rows, "eval/greedy_exact_match")[STEPS] <= 1.0

    lines = printed.splitlines()
    assert sum(line.startswith("step ") for line in lines) == STEPS
    assert [line.split("|")[0].split()[1] for line in lines if line.startswith("eval ")] == ["0", "4", "8"]
    assert any(line.startswith("greedy exact match of the export: ") for line in lines)

    # Everything a resume or a reader needs is in the run dir.
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step_00000004", "step_00000008"]
    assert (
        RunCheckpointer(run_dir / "checkpoints", keep=2).newest_intact()
        == run_dir / "checkpoints" / "step_00000008"
    )
    assert load_config(SFTConfig, run_dir / "config.yaml").trainer.engine.model.vocab_size == len(
        embedded_tokenizer()
    )


def test_export_matches_the_trainer_logits(straight_run):
    run_dir, _, _ = straight_run
    export = run_dir / "export"
    assert {"model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in export.iterdir()
    }
    tokenizer = AutoTokenizer.from_pretrained(export)
    tokens = torch.tensor([tokenizer("12+34=46").input_ids, tokenizer("56+21=77").input_ids])

    # The trainer's weights at the end: its last checkpoint, in the engine the trainer runs.
    engine = TitanEngine(load_config(SFTConfig, run_dir / "config.yaml").trainer.engine)
    engine.load_from(run_dir / "checkpoints" / f"step_{STEPS:08d}" / "trainer")
    hf_model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    with torch.no_grad():
        hf_logits = hf_model(tokens).logits
    torch.testing.assert_close(hf_logits, engine.forward(tokens), rtol=0, atol=1e-4)


def test_resume_continues_exactly(straight_run, tmp_path):
    _, straight, _ = straight_run
    # Stop after 6 steps, as if it crashed before the checkpoint of step 6 was written...
    run_app(tmp_path, "max_steps=6", "checkpoint.every=4", "~export_dir", "~generation_eval")
    shutil.rmtree(tmp_path / "checkpoints" / "step_00000006")
    # ...and resume: from step 4, with the model, optimizer, LR schedule and data position.
    resumed, printed = run_app(
        tmp_path, f"max_steps={STEPS}", "checkpoint.every=4", "resume=true", "~export_dir", "~generation_eval"
    )
    assert "resume: continuing from the checkpoint of step 4" in printed

    # Steps 5 and 6 are logged once, by the resumed run.
    assert [row["step"] for row in resumed if "train/loss" in row] == list(range(1, STEPS + 1))
    for key in ("train/loss", "train/lr", "data/epoch", "eval/loss"):
        assert by_step(resumed, key) == pytest.approx(by_step(straight, key), rel=1e-6, abs=1e-7), key


def test_resume_auto_starts_afresh_and_a_fresh_start_refuses_existing_checkpoints(tmp_path, capsys):
    rows, printed = run_app(
        tmp_path, "max_steps=2", "checkpoint.every=1", "resume=auto", "~export_dir", "~generation_eval"
    )
    assert "resume: no checkpoint yet, starting from step 0" in printed
    assert sorted(by_step(rows, "train/loss")) == [1, 2]
    checkpoints = RunCheckpointer(tmp_path / "checkpoints", keep=2).complete()
    assert [path.name for path in checkpoints] == ["step_00000001", "step_00000002"]
    err = run_expecting_exit(capsys, f"run_dir={tmp_path}")
    assert "already holds checkpoints (newest: step_00000002)" in err and "another run_dir" in err


def test_too_long_examples_are_counted_in_the_metrics(tmp_path):
    tokenizer_dir = tmp_path / "tokenizer"
    embedded_tokenizer().save_pretrained(tokenizer_dir)
    rows = [{"prompt": f"{i}+{i}=", "completion": str(2 * i)} for i in range(30)]
    rows += [{"prompt": "1+" * 20 + "1=", "completion": "21"}, {"prompt": "2+2=", "completion": "4" * 40}]
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))

    metrics, printed = run_app(
        tmp_path / "run",
        "~data.embedded_task",
        f"data.path={data}",
        f"tokenizer_path={tokenizer_dir}",
        "data.max_seq_len=16",
        "data.overflow=drop",
        "max_steps=1",
        "~export_dir",
        "~generation_eval",
    )
    assert metrics[0]["data/train_dropped"] == 2 and metrics[0]["data/train_examples"] == 30
    assert "0 truncated, 2 dropped" in printed


def run_expecting_exit(capsys, *overrides: str) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(["--config", str(TINY_CPU), *overrides])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_a_missing_column_names_the_file_and_the_column(tmp_path, capsys):
    data = tmp_path / "answers.jsonl"
    data.write_text('{"prompt": "1+1=", "answer": "2"}\n')
    embedded_tokenizer().save_pretrained(tmp_path / "tokenizer")
    err = run_expecting_exit(
        capsys,
        f"run_dir={tmp_path / 'run'}",
        "~data.embedded_task",
        f"data.path={data}",
        "data.format=prompt_completion",
        f"tokenizer_path={tmp_path / 'tokenizer'}",
        "~generation_eval",
    )
    assert f"{data}: missing column 'completion'" in err


def test_config_mistakes_are_named(tmp_path, capsys):
    err = run_expecting_exit(capsys, f"run_dir={tmp_path}", "trainer.engine.optimzer.lr=1")
    assert "unknown key 'trainer.engine.optimzer'" in err and "Did you mean 'optimizer'?" in err
    err = run_expecting_exit(capsys, f"run_dir={tmp_path}", "data.batch_size=3", "trainer.procs=2")
    assert "data.batch_size (3) must be a multiple of the trainer's data-parallel size (2" in err
    # LoRA: a checkpoint to adapt (its adapter export loads onto it); its merged model on request,
    # which the generation eval needs.
    err = run_expecting_exit(capsys, f"run_dir={tmp_path}", "trainer.engine.lora.rank=4")
    assert (
        "trainer.engine.lora adapts a pretrained model" in err and "set trainer.engine.model.hf_path" in err
    )
    err = run_expecting_exit(capsys, f"run_dir={tmp_path}", "export_merged=true")
    assert "export_merged writes a LoRA run's merged model into export_dir/merged: it needs" in err
    lora = [
        "trainer.engine.lora.rank=4",
        f"trainer.engine.model.hf_path={tmp_path}",
        "~trainer.engine.model.flavor",
    ]
    err = run_expecting_exit(capsys, f"run_dir={tmp_path}", *lora)
    assert "with trainer.engine.lora export_dir holds the adapter alone: set export_merged: true" in err


def test_a_new_model_sized_otherwise_than_the_tokenizer_and_an_unwritable_run_dir(tmp_path, capsys):
    small = ["data.embedded_task.num_train=64", "data.embedded_task.num_eval=8"]
    run_dir = tmp_path / "run"
    err = run_expecting_exit(capsys, f"run_dir={run_dir}", *small, "trainer.engine.model.vocab_size=128")
    tokens = len(embedded_tokenizer())
    assert f"trainer.engine.model.vocab_size is 128 but the tokenizer at {run_dir}" in err
    assert f"has {tokens} tokens" in err and f"Set trainer.engine.model.vocab_size={tokens}" in err
    assert not (run_dir / "checkpoints").exists()
    (tmp_path / "a_file").write_text("")
    err = run_expecting_exit(capsys, f"run_dir={tmp_path / 'a_file' / 'run'}", *small)
    assert f"run_dir: cannot write to {tmp_path / 'a_file' / 'run'} (Not a directory)" in err


def test_gpu_demo_warm_start_config_runs_two_steps(tmp_path):
    # As shipped and as the GPU demo starts it (the `small` flavor included), shortened to 2
    # steps on a little data.
    config = TINY_CPU.parent / "gpu_demo.yaml"
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(
            [
                "--config",
                str(config),
                f"run_dir={tmp_path}",
                "max_steps=2",
                "data.embedded_task.num_train=64",
                "data.embedded_task.num_eval=16",
                "data.batch_size=16",
                "generation_eval.num_prompts=8",
                *warm_start_overrides("gpu_demo.yaml"),
            ]
        )
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sorted(by_step(rows, "train/loss")) == [1, 2]
    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert (exported["hidden_size"], exported["num_hidden_layers"]) == (256, 4)  # the small flavor
    assert "greedy exact match of the export" in out.getvalue()


def test_sft_on_your_chat_files_and_checkpoint_runs_as_the_readme_says(tmp_path):
    """The README's recipe for your own data, on chat (`messages`) files: no tokenizer_path (a
    checkpoint directory holds its tokenizer, taken from trainer.engine.model.hf_path), and the
    greedy generation eval on the eval file's prompts, each chat's last answer its target. The
    checkpoint is a Qwen3 saved by transformers, with more embedding rows than the tokenizer has
    tokens and no model keys in the config: SFT trains it and exports the same model."""
    source = make_checkpoint(tmp_path, "qwen3_untied")
    for name, count in (("train", 32), ("eval", 4)):
        (tmp_path / f"{name}.jsonl").write_text(
            "".join(
                json.dumps(
                    {
                        "messages": [
                            {"role": "user", "content": f"{a}+1="},
                            {"role": "assistant", "content": str(a + 1)},
                        ]
                    }
                )
                + "\n"
                for a in range(count)
            )
        )
    run_dir = tmp_path / "run"
    rows, printed = run_app(
        run_dir,
        "max_steps=2",
        "data.batch_size=8",
        "~data.embedded_task",
        f"data.path={tmp_path / 'train.jsonl'}",
        f"data.eval_path={tmp_path / 'eval.jsonl'}",
        f"trainer.engine.model.hf_path={source}",
        "~trainer.engine.model.name",
        "~trainer.engine.model.flavor",
    )
    assert sorted(by_step(rows, "train/loss")) == [1, 2]
    assert "greedy exact match of the export: " in printed and "on 4 eval prompts" in printed
    assert any("eval/greedy_exact_match" in row for row in rows)
    export = run_dir / "export"
    assert json.loads((export / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text()
    )
    assert load_config(SFTConfig, run_dir / "config.yaml").trainer.engine.model.vocab_size is None
    assert (run_dir / "tokenizer" / "tokenizer.json").read_text() == (source / "tokenizer.json").read_text()


def test_sft_with_lora_trains_its_adapters_and_exports_them_for_peft_and_merged(tmp_path):
    """SFT with trainer.engine.lora on a Qwen3 saved by transformers: the loss falls; export_dir is
    the PEFT adapter, which peft loads onto the input checkpoint with the trainer's logits; and
    export_merged's model is the checkpoint plus alpha/rank B A of that adapter's tensors, every
    other weight the checkpoint's bit for bit (only the adapters trained). The generation eval
    runs on the merged model."""
    from peft import PeftModel
    from safetensors.torch import load_file

    source = make_checkpoint(tmp_path, "qwen3_untied")
    run_dir, steps = tmp_path / "run", 6
    rows, printed = run_app(
        run_dir,
        f"max_steps={steps}",
        f"checkpoint.every={steps}",
        f"trainer.engine.model.hf_path={source}",
        "~trainer.engine.model.name",
        "~trainer.engine.model.flavor",
        "trainer.engine.lora.rank=4",
        "trainer.engine.lora.alpha=8",  # scaling 2: a scaling left out would show
        "trainer.engine.optimizer.lr=0.02",
        "export_merged=true",
    )
    loss, eval_loss = by_step(rows, "train/loss"), by_step(rows, "eval/loss")
    assert sorted(loss) == list(range(1, steps + 1)) and loss[steps] < loss[1], loss
    # The held-out loss of a random checkpoint falls toward the task's (4.23 to 3.66 when written).
    assert eval_loss[steps] < eval_loss[0] - 0.3, eval_loss
    adapter, merged = run_dir / "export", run_dir / "export" / "merged"
    assert f"exported the LoRA adapter (PEFT) to {adapter}" in printed
    assert f"exported the model to {merged}" in printed and "greedy exact match of the export" in printed
    settings = json.loads((adapter / "adapter_config.json").read_text())
    assert (settings["r"], settings["lora_alpha"], settings["base_model_name_or_path"]) == (4, 8, str(source))

    # The trainer's weights at the end: its last checkpoint (the adapters), in the engine it runs.
    # (Its model section names the checkpoint alone, as the run's did before its defaults were written.)
    engine_config = load_config(SFTConfig, run_dir / "config.yaml").trainer.engine
    engine = TitanEngine(engine_config.model_copy(update={"model": ModelConfig(hf_path=str(source))}))
    engine.load_from(run_dir / "checkpoints" / f"step_{steps:08d}" / "trainer")
    tokens = torch.tensor([[1, 12, 14, 20, 13, 16, 22, 2], [1, 17, 18, 20, 19, 13, 22, 2]])
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(source), adapter).eval()
    with torch.no_grad():
        peft_logits = peft_model(tokens).logits
    torch.testing.assert_close(peft_logits, engine.forward(tokens), rtol=0, atol=1e-4)

    base, tensors = load_file(source / "model.safetensors"), load_file(adapter / "adapter_model.safetensors")
    exported = {name: t for path in merged.glob("*.safetensors") for name, t in load_file(path).items()}
    assert exported.keys() == base.keys()
    adapted = set()
    for name, weight in exported.items():
        prefix = f"base_model.model.{name.removesuffix('.weight')}"
        if f"{prefix}.lora_A.weight" not in tensors:
            assert torch.equal(weight, base[name]), name
            continue
        update = 2.0 * tensors[f"{prefix}.lora_B.weight"] @ tensors[f"{prefix}.lora_A.weight"]
        torch.testing.assert_close(weight, base[name] + update, rtol=0, atol=1e-6, msg=name)
        assert update.abs().max() > 1e-3, name  # the adapters moved
        adapted.add(name)
    assert len(adapted) == 2 * 7 == len(tensors) // 2  # every linear layer of both blocks
