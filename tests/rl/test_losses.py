"""forge.rl.losses against plain float64 references written with Python loops and math."""

import math

import pytest
import torch
from reference_math import ref_aggregate, ref_entropy, ref_kl, ref_logprob

from forge.rl.batch import PolicyBatch
from forge.rl.losses import LOSSES, CISPOLoss, DAPOLoss, GRPOLoss, GSPOLoss, LossOutput, SFTLoss, build_loss
from forge.rl.losses.ppo import GRPOLossConfig

# --- the float64 references of each loss, built on tests/support/reference_math.py -------------


DEFAULTS = {
    "grpo": {
        "clip_low": 0.2,
        "clip_high": 0.2,
        "beta": 0.0,
        "kl_estimator": "k3",
        "agg_type": "fixed_horizon",
    },
    "ppo": {"clip_low": 0.2, "clip_high": 0.2, "agg_type": "token_mean"},
    "dapo": {"clip_low": 0.2, "clip_high": 0.28, "agg_type": "token_mean"},
    "gspo": {"clip_low": 3e-4, "clip_high": 4e-4, "agg_type": "sequence_mean"},
    "cispo": {"clip_high": 0.28, "agg_type": "token_mean"},
    "reinforce": {"tis_cap": None, "agg_type": "token_mean"},
}


OFF_POLICY_DEFAULTS = {
    "off_policy": "none",
    "tis_cap": 2.0,
    "icepop_low": 0.5,
    "icepop_high": 2.0,
    "behaviour_cap": None,
}


def ref_behaviour_weight(cfg, prox: float, behaviour: float) -> tuple[float, bool, bool]:
    """(weight, truncated, masked) of one token under the configured off-policy correction."""
    m = math.exp(prox - behaviour)
    if cfg["off_policy"] == "tis":
        return min(m, cfg["tis_cap"]), m > cfg["tis_cap"], False
    if cfg["off_policy"] == "icepop":
        inside = cfg["icepop_low"] <= m <= cfg["icepop_high"]
        return (m if inside else 0.0), False, not inside
    cap = cfg["behaviour_cap"]
    masked = cap is not None and m > cap
    return (0.0 if masked else m), False, masked


def ref_policy_loss(name, params, logprobs, advantages, generator, mask, ref=None, frozen=None, step=None):
    """(loss, metrics) of a policy loss from per-token lists; ``frozen`` are the logprobs that
    stop-gradient terms are computed from (the trainer's own, unless a test freezes them): the
    proximal policy and the importance weights. ``step``: the step's (tokens, sequences)."""
    cfg = {**OFF_POLICY_DEFAULTS, **DEFAULTS[name], "horizon": None, **params}
    frozen = frozen or logprobs
    batch, length = len(logprobs), len(logprobs[0])
    keep = [
        [bool(mask[b][t]) and (name != "dapo" or math.isfinite(generator[b][t])) for t in range(length)]
        for b in range(batch)
    ]
    corrected = cfg["off_policy"] != "none"
    old = frozen if corrected else generator

    def agg(values, mode):
        # Dropped tokens contribute zero but count: denominators come from the mask (or the step).
        kept = [[values[b][t] if keep[b][t] else 0.0 for t in range(length)] for b in range(batch)]
        return ref_aggregate(kept, mask, mode, cfg["horizon"] if mode == cfg["agg_type"] else None, step)

    ratio = [
        [math.exp(logprobs[b][t] - old[b][t]) if keep[b][t] else 1.0 for t in range(length)]
        for b in range(batch)
    ]
    if name == "gspo":
        for b in range(batch):
            log_ratios = [logprobs[b][t] - old[b][t] for t in range(length) if keep[b][t]]
            ratio[b] = [math.exp(sum(log_ratios) / len(log_ratios))] * length
    pg = [[0.0] * length for _ in range(batch)]
    flags = {k: [[False] * length for _ in range(batch)] for k in ("low", "high", "truncated", "masked")}
    weights = [[0.0] * length for _ in range(batch)]
    for b in range(batch):
        for t in range(length):
            if not keep[b][t]:
                continue
            r, a = ratio[b][t], advantages[b][t]
            if name in ("grpo", "ppo", "dapo", "gspo"):
                low, high = 1 - cfg["clip_low"], 1 + cfg["clip_high"]
                pg[b][t] = -min(r * a, min(max(r, low), high) * a)
                flags["low"][b][t] = r < low and a < 0
                flags["high"][b][t] = r > high and a > 0
                if corrected:
                    weight, flags["truncated"][b][t], flags["masked"][b][t] = ref_behaviour_weight(
                        cfg, frozen[b][t], generator[b][t]
                    )
                    weights[b][t] = weight
                    pg[b][t] *= weight
            else:
                cap = 1 + cfg["clip_high"] if name == "cispo" else cfg["tis_cap"]
                weight = 1.0 if cap is None else min(math.exp(frozen[b][t] - generator[b][t]), cap)
                pg[b][t] = -weight * a * logprobs[b][t]
                flags["high"][b][t] = cap is not None and r > cap
    metrics = {
        "loss/pg": agg(pg, cfg["agg_type"]),
        "loss/ratio_mean": agg(ratio, "token_mean"),
        "loss/ratio_max": max(
            r for rs, ks in zip(ratio, keep, strict=True) for r, k in zip(rs, ks, strict=True) if k
        ),
        "loss/mismatch_kl": agg(
            [
                [ref_kl(generator[b][t], logprobs[b][t], "k3") if keep[b][t] else 0.0 for t in range(length)]
                for b in range(batch)
            ],
            "token_mean",
        ),
    }
    if name != "reinforce" or cfg["tis_cap"] is not None:
        metrics["loss/clip_frac_high"] = agg(flags["high"], "token_mean")
    if name in ("grpo", "ppo", "dapo", "gspo"):
        metrics["loss/clip_frac_low"] = agg(flags["low"], "token_mean")
    if corrected:
        metrics["loss/is_weight_mean"] = agg(weights, "token_mean")
        kind = "truncated" if cfg["off_policy"] == "tis" else "masked"
        metrics[f"loss/is_{kind}_frac"] = agg(flags[kind], "token_mean")
    if name == "dapo":
        metrics["loss/nonfinite_generator_logprobs"] = sum(
            1 for b in range(batch) for t in range(length) if mask[b][t] and not keep[b][t]
        )
    loss = metrics["loss/pg"]
    if name == "grpo" and ref is not None:
        kl = [
            [ref_kl(logprobs[b][t], ref[b][t], cfg["kl_estimator"]) for t in range(length)]
            for b in range(batch)
        ]
        metrics["loss/kl"] = agg(kl, cfg["agg_type"])
        loss = agg(
            [[pg[b][t] + cfg["beta"] * kl[b][t] for t in range(length)] for b in range(batch)],
            cfg["agg_type"],
        )
    return loss, metrics


# --- shared inputs ------------------------------------------------------------------------------

B, T, V = 3, 5, 6
MASK = torch.tensor([[0, 1, 1, 1, 0], [0, 0, 1, 1, 1], [1, 1, 0, 0, 0]])
# Trainer-vs-generator log-ratios chosen to land inside and outside the clip ranges, away from
# their edges (so that finite differences never straddle a kink).
LOG_RATIO = torch.tensor(
    [[0.0, 0.3, -0.5, 0.05, 0.0], [0.0, 0.0, -0.1, 0.6, -0.25], [0.15, -0.02, 0.0, 0.0, 0.0]],
    dtype=torch.float64,
)
SEQ_ADVANTAGES = torch.tensor([1.0, -0.7, 0.4], dtype=torch.float64)
TOKEN_ADVANTAGES = torch.tensor(
    [[0.0, 0.5, -1.2, 0.8, 0.0], [0.0, 0.0, 1.1, -0.4, 0.3], [-0.9, 0.6, 0.0, 0.0, 0.0]], dtype=torch.float64
)


def make_batch(temperature: float = 1.0, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, T, V, generator=gen, dtype=torch.float64) * 2
    targets = torch.randint(0, V, (B, T), generator=gen)
    rows = logits.tolist()
    trainer = torch.tensor(
        [[ref_logprob(rows[b][t], int(targets[b, t]), temperature) for t in range(T)] for b in range(B)],
        dtype=torch.float64,
    )
    generator_logprobs = trainer - LOG_RATIO
    ref_logprobs = trainer + torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.3
    return logits, targets, generator_logprobs, ref_logprobs


CASES = [
    ("grpo", {}, "seq", False),
    ("grpo", {"beta": 0.05}, "seq", True),
    (
        "grpo",
        {"beta": 0.1, "kl_estimator": "k2", "agg_type": "sequence_mean", "temperature": 0.7},
        "token",
        True,
    ),
    ("grpo", {"beta": 0.02, "kl_estimator": "low_var_kl", "horizon": 16}, "seq", True),
    ("grpo", {"kl_estimator": "k1", "agg_type": "sequence_sum"}, "seq", True),
    ("ppo", {}, "token", False),
    ("ppo", {"clip_low": 0.1, "clip_high": 0.3, "off_policy": "tis", "tis_cap": 1.2}, "token", False),
    ("dapo", {}, "seq", False),
    ("dapo", {"clip_low": 0.1, "clip_high": 0.5, "agg_type": "sequence_mean"}, "token", False),
    ("gspo", {}, "seq", False),
    ("gspo", {"clip_low": 0.05, "clip_high": 0.07, "agg_type": "token_mean"}, "seq", False),
    ("cispo", {}, "seq", False),
    ("cispo", {"clip_high": 0.1, "agg_type": "fixed_horizon", "temperature": 1.3}, "token", False),
    ("reinforce", {}, "seq", False),
    ("reinforce", {"tis_cap": 1.2, "agg_type": "sequence_mean"}, "token", False),
    ("grpo", {"beta": 0.05, "off_policy": "tis", "tis_cap": 1.2}, "seq", True),
    ("dapo", {"off_policy": "icepop", "icepop_low": 0.8, "icepop_high": 1.25}, "token", False),
    ("dapo", {"off_policy": "decoupled"}, "seq", False),
    ("gspo", {"off_policy": "decoupled", "behaviour_cap": 1.5, "agg_type": "fixed_horizon"}, "seq", False),
]
CASE_IDS = [f"{name}-{i}" for i, (name, *_) in enumerate(CASES)]


def case_inputs(name, params, advantage_kind, with_ref):
    temperature = params.get("temperature", 1.0)
    logits, targets, generator_logprobs, ref_logprobs = make_batch(temperature)
    advantages = SEQ_ADVANTAGES if advantage_kind == "seq" else TOKEN_ADVANTAGES
    return logits, targets, advantages, generator_logprobs, (ref_logprobs if with_ref else None)


def policy_batch(targets, advantages, generator_logprobs, mask, ref_logprobs=None, step=None) -> PolicyBatch:
    return PolicyBatch(
        target_ids=targets,
        loss_mask=mask,
        advantages=advantages,
        generator_logprobs=generator_logprobs,
        ref_logprobs=ref_logprobs,
        step_tokens=None if step is None else torch.tensor(step[0]),
        step_sequences=None if step is None else torch.tensor(step[1]),
    )


def per_token(advantages: torch.Tensor) -> list[list[float]]:
    return (advantages[:, None].expand(B, T) if advantages.dim() == 1 else advantages).tolist()


# --- values and metrics -------------------------------------------------------------------------


@pytest.mark.parametrize("step", [None, (20, 7)], ids=["batch", "step"])
@pytest.mark.parametrize(("name", "params", "advantage_kind", "with_ref"), CASES, ids=CASE_IDS)
def test_policy_loss_matches_reference(name, params, advantage_kind, with_ref, step):
    """On its own, and as a share of a step of 20 tokens in 7 sequences."""
    logits, targets, advantages, generator_logprobs, ref_logprobs = case_inputs(
        name, params, advantage_kind, with_ref
    )
    out = build_loss(name, **params)(
        logits, policy_batch(targets, advantages, generator_logprobs, MASK, ref_logprobs, step)
    )

    temperature = params.get("temperature", 1.0)
    rows = logits.tolist()
    logprobs = [
        [ref_logprob(rows[b][t], int(targets[b, t]), temperature) for t in range(T)] for b in range(B)
    ]
    want_loss, want_metrics = ref_policy_loss(
        name,
        params,
        logprobs,
        per_token(advantages),
        generator_logprobs.tolist(),
        MASK.tolist(),
        None if ref_logprobs is None else ref_logprobs.tolist(),
        step=step,
    )
    entropy = [[ref_entropy(rows[b][t], temperature) for t in range(T)] for b in range(B)]
    want_metrics["loss/entropy"] = ref_aggregate(entropy, MASK.tolist(), "token_mean", step=step)

    assert out.loss.item() == pytest.approx(want_loss, rel=1e-10, abs=1e-12)
    assert set(out.metrics) == set(want_metrics)
    for key, want in want_metrics.items():
        assert out.metrics[key] == pytest.approx(want, rel=1e-10, abs=1e-12), key


def test_policy_losses_see_the_off_policy_ratio():
    """The ratio is against the generator's logprobs, not a detached copy of the trainer's (always 1)."""
    logits, targets, generator_logprobs, _ = make_batch()
    out = GRPOLoss()(logits, policy_batch(targets, SEQ_ADVANTAGES, generator_logprobs, MASK))
    assert out.metrics["loss/ratio_max"] == pytest.approx(math.exp(0.6), rel=1e-9)
    assert out.metrics["loss/clip_frac_high"] > 0 and out.metrics["loss/clip_frac_low"] > 0


def test_grpo_reports_pg_and_kl_that_add_up_to_the_loss():
    logits, targets, generator_logprobs, ref_logprobs = make_batch()
    out = GRPOLoss(beta=0.3)(
        logits, policy_batch(targets, SEQ_ADVANTAGES, generator_logprobs, MASK, ref_logprobs)
    )
    assert out.loss.item() == pytest.approx(out.metrics["loss/pg"] + 0.3 * out.metrics["loss/kl"], rel=1e-12)


@pytest.mark.parametrize("name", ["grpo", "ppo", "dapo", "cispo", "reinforce"])
def test_an_entropy_bonus_lowers_the_loss_by_its_share_of_the_mean_entropy(name):
    """entropy_coef: the loss minus entropy_coef times the entropy's token mean over the response
    tokens (float64 reference), with that term's gradient; 0 leaves the loss as it was."""
    logits, targets, generator_logprobs, _ = make_batch()
    logits.requires_grad_(True)
    batch = policy_batch(targets, SEQ_ADVANTAGES, generator_logprobs, MASK)
    plain = build_loss(name)(logits, batch)
    bonus = build_loss(name, entropy_coef=0.05)(logits, batch)
    rows = logits.detach().tolist()
    entropies = [ref_entropy(rows[b][t]) for b in range(B) for t in range(T) if MASK[b, t]]
    mean_entropy = sum(entropies) / len(entropies)
    assert bonus.metrics["loss/entropy"] == pytest.approx(mean_entropy, rel=1e-6)
    assert bonus.loss.item() == pytest.approx(plain.loss.item() - 0.05 * mean_entropy, rel=1e-9, abs=1e-12)
    # The difference of the gradients is the entropy term's: -0.05 d(mean entropy)/d(logits).
    (plain_grad,) = torch.autograd.grad(plain.loss, logits)
    (bonus_grad,) = torch.autograd.grad(bonus.loss, logits)
    log_probs = torch.log_softmax(logits, -1)
    token_entropy = -(log_probs.exp() * log_probs).sum(-1)
    mean = (token_entropy * MASK).sum() / MASK.sum()
    (entropy_grad,) = torch.autograd.grad(mean, logits)
    torch.testing.assert_close(bonus_grad - plain_grad, -0.05 * entropy_grad, rtol=1e-6, atol=1e-9)
    with pytest.raises(ValueError, match="entropy_coef"):
        build_loss(name, entropy_coef=-0.1)


def test_dapo_drops_and_counts_tokens_with_nonfinite_generator_logprobs():
    logits, targets, generator_logprobs, _ = make_batch()
    generator_logprobs[1, 3], generator_logprobs[2, 0] = -math.inf, math.nan
    out = DAPOLoss()(logits, policy_batch(targets, SEQ_ADVANTAGES, generator_logprobs, MASK))
    rows = logits.tolist()
    logprobs = [[ref_logprob(rows[b][t], int(targets[b, t])) for t in range(T)] for b in range(B)]
    want_loss, want_metrics = ref_policy_loss(
        "dapo", {}, logprobs, per_token(SEQ_ADVANTAGES), generator_logprobs.tolist(), MASK.tolist()
    )
    assert math.isfinite(out.loss.item())
    assert out.loss.item() == pytest.approx(want_loss, rel=1e-10)
    assert out.metrics["loss/nonfinite_generator_logprobs"] == 2
    assert out.metrics["loss/mismatch_kl"] == pytest.approx(want_metrics["loss/mismatch_kl"], rel=1e-10)


def test_sft_loss_matches_reference():
    logits, targets, _, _ = make_batch()
    targets[0, 1] = int(logits[0, 1].argmax())  # at least one correct prediction
    out = SFTLoss()(logits, PolicyBatch(target_ids=targets, loss_mask=MASK))
    rows = logits.tolist()
    nll = [[-ref_logprob(rows[b][t], int(targets[b, t])) for t in range(T)] for b in range(B)]
    correct = [
        [float(max(range(V), key=lambda v: rows[b][t][v]) == targets[b, t]) for t in range(T)]
        for b in range(B)
    ]
    want = ref_aggregate(nll, MASK.tolist(), "token_mean")
    assert out.loss.item() == pytest.approx(want, rel=1e-12)
    assert out.metrics == pytest.approx(
        {
            "sft/loss": want,
            "sft/token_accuracy": ref_aggregate(correct, MASK.tolist(), "token_mean"),
        },
        rel=1e-12,
    )
    all_tokens = SFTLoss(agg_type="sequence_sum")(logits, PolicyBatch(targets, torch.ones(B, T)))
    assert all_tokens.loss.item() == pytest.approx(
        ref_aggregate(nll, [[1] * T] * B, "sequence_sum"), rel=1e-12
    )
    step = SFTLoss()(logits, PolicyBatch(targets, MASK, step_tokens=torch.tensor(30)))
    assert step.loss.item() == pytest.approx(ref_aggregate(nll, MASK.tolist(), "token_mean", step=(30, 9)))


# --- gradients ----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "params", "advantage_kind", "with_ref"), CASES, ids=CASE_IDS)
def test_policy_loss_gradient_matches_reference(name, params, advantage_kind, with_ref):
    """Autograd through ``loss_from_logprobs`` vs central differences of the reference, whose
    stop-gradient weights stay frozen at the unperturbed logprobs."""
    _, _, advantages, generator_logprobs, ref_logprobs = case_inputs(name, params, advantage_kind, with_ref)
    logprobs = (generator_logprobs + LOG_RATIO).requires_grad_()
    loss_fn = build_loss(name, **params)
    loss_fn.loss_from_logprobs(
        logprobs, policy_batch(None, advantages, generator_logprobs, MASK, ref_logprobs)
    ).loss.backward()

    base = logprobs.tolist()
    args = (
        per_token(advantages),
        generator_logprobs.tolist(),
        MASK.tolist(),
        None if ref_logprobs is None else ref_logprobs.tolist(),
    )
    step = 1e-6
    for b in range(B):
        for t in range(T):
            shifted = []
            for sign in (1, -1):
                moved = [row[:] for row in base]
                moved[b][t] += sign * step
                shifted.append(ref_policy_loss(name, params, moved, *args, frozen=base)[0])
            want = (shifted[0] - shifted[1]) / (2 * step)
            assert logprobs.grad[b, t].item() == pytest.approx(want, abs=1e-8), (b, t)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    _, _, generator_logprobs, _ = make_batch()
    logprobs = (generator_logprobs + LOG_RATIO).requires_grad_()
    CISPOLoss(clip_high=0.1).loss_from_logprobs(
        logprobs, policy_batch(None, SEQ_ADVANTAGES, generator_logprobs, MASK)
    ).loss.backward()
    tokens = int(MASK.sum())
    # token (0, 1) has ratio e^0.3 > 1.1 with A = 1: PPO-clip would drop it, CISPO weighs it by 1.1
    assert logprobs.grad[0, 1].item() == pytest.approx(-1.1 * 1.0 / tokens, rel=1e-12)


@pytest.mark.parametrize("agg_type", ["token_mean", "sequence_mean", "sequence_sum", "fixed_horizon"])
def test_microbatch_shares_add_up_to_the_step(agg_type):
    """Given the step's counts, the losses and metrics of row microbatches add up to the whole
    batch's (the max is the max), and so do their gradients."""
    logits, targets, generator_logprobs, ref_logprobs = make_batch()
    loss_fn = GRPOLoss(beta=0.1, agg_type=agg_type, off_policy="tis", tis_cap=1.2)
    tokens, sequences = PolicyBatch(targets, MASK).counts()
    whole = policy_batch(
        targets, TOKEN_ADVANTAGES, generator_logprobs, MASK, ref_logprobs, (tokens, sequences)
    )
    results = []
    for parts in ([whole], whole.split(1)):
        leaf = logits.clone().requires_grad_()
        outs = [
            loss_fn(leaf[i : i + p.num_rows], p)
            for i, p in zip(range(0, B, parts[0].num_rows), parts, strict=True)
        ]
        sum(out.loss for out in outs).backward()
        metrics = {k: sum(out.metrics[k] for out in outs) for k in outs[0].metrics}
        metrics["loss/ratio_max"] = max(out.metrics["loss/ratio_max"] for out in outs)
        results.append((sum(out.loss.item() for out in outs), metrics, leaf.grad))
    (loss, metrics, grad), (split_loss, split_metrics, split_grad) = results
    assert split_loss == pytest.approx(loss, rel=1e-12)
    assert split_metrics == pytest.approx(metrics, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(split_grad, grad, rtol=1e-12, atol=1e-15)
    assert outs[0].reductions == {"loss/ratio_max": "max"}


@pytest.mark.parametrize("correction", ["tis", "icepop", "decoupled"])
def test_behaviour_weight_corrects_stale_tokens(correction):
    """The clipped ratio is against the proximal policy (the trainer's detached logprobs), 1 in
    value; the correction is the behaviour weight pi_prox / pi_generator, which is not 1 on stale
    tokens: each token's gradient is -w A / #tokens, unlike the uncorrected -A / #tokens."""
    _, _, generator_logprobs, _ = make_batch()
    logprobs = (generator_logprobs + LOG_RATIO).requires_grad_()
    params = {"tis": {"tis_cap": 1.5}, "icepop": {"icepop_low": 0.7, "icepop_high": 1.5}, "decoupled": {}}
    out = DAPOLoss(off_policy=correction, **params[correction]).loss_from_logprobs(
        logprobs, policy_batch(None, SEQ_ADVANTAGES, generator_logprobs, MASK)
    )
    out.loss.backward()
    assert out.metrics["loss/ratio_max"] == pytest.approx(1.0) and out.metrics["loss/clip_frac_high"] == 0
    assert abs(out.metrics["loss/is_weight_mean"] - 1) > 0.01
    tokens = int(MASK.sum())
    for b in range(B):
        for t in range(T):
            m = math.exp(LOG_RATIO[b, t].item())
            weight = {
                "tis": min(m, 1.5),
                "icepop": m if 0.7 <= m <= 1.5 else 0.0,
                "decoupled": m,
            }[correction]
            want = -weight * SEQ_ADVANTAGES[b].item() / tokens if MASK[b, t] else 0.0
            assert logprobs.grad[b, t].item() == pytest.approx(want, rel=1e-12, abs=1e-15), (b, t)
    if correction != "decoupled":
        assert out.metrics["loss/is_truncated_frac" if correction == "tis" else "loss/is_masked_frac"] > 0


def test_off_policy_parameters_belong_to_their_correction():
    with pytest.raises(ValueError, match="tis_cap only applies to off_policy='tis'"):
        GRPOLoss(off_policy="icepop", tis_cap=3.0)
    with pytest.raises(ValueError, match="icepop_low"):
        DAPOLoss(off_policy="icepop", icepop_low=2.0, icepop_high=1.5)
    with pytest.raises(ValueError, match="off_policy"):
        GRPOLoss(off_policy="areal")
    assert GSPOLoss(off_policy="decoupled", behaviour_cap=3.0).config.behaviour_cap == 3.0


@pytest.mark.parametrize("advantage", [1.0, -1.0])
def test_grpo_clip_boundaries_at_the_loss_level(advantage):
    """One token per sequence with ratios one step inside, on, and one step outside each edge."""
    clip = 0.2
    ratios = [r + d for r in (1 - clip, 1 + clip) for d in (-1e-9, 0.0, 1e-9)]
    logprobs = torch.tensor([[math.log(r)] for r in ratios], dtype=torch.float64, requires_grad=True)
    zeros = torch.zeros_like(logprobs)
    advantages = torch.full((len(ratios),), advantage, dtype=torch.float64)
    out = GRPOLoss(clip_low=clip, clip_high=clip).loss_from_logprobs(
        logprobs, policy_batch(None, advantages, zeros, torch.ones_like(zeros))
    )
    out.loss.backward()
    n = len(ratios)
    for i, r in enumerate(ratios):
        clipped = (advantage > 0 and r > 1 + clip + 1e-12) or (advantage < 0 and r < 1 - clip - 1e-12)
        # d/dlogp of -r A / n is -r A / n; a clipped token has none
        want = 0.0 if clipped else -r * advantage / n
        assert logprobs.grad[i, 0].item() == pytest.approx(want, rel=1e-6, abs=1e-15), r
    want_loss = sum(-min(r * advantage, min(max(r, 1 - clip), 1 + clip) * advantage) for r in ratios) / n
    assert out.loss.item() == pytest.approx(want_loss, rel=1e-12)
    assert out.metrics["loss/clip_frac_high" if advantage > 0 else "loss/clip_frac_low"] == pytest.approx(
        1 / n
    )


def gradcheck_logits(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64).requires_grad_()
    targets = torch.randint(0, 5, (3, 4), generator=gen)
    mask = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0], [0, 0, 1, 1]])
    return logits, targets, mask


def test_grpo_gradcheck():
    logits, targets, mask = gradcheck_logits()
    log_ratio = torch.tensor(
        [[0, 0.5, -0.1, 0.05], [-0.6, 0.1, 0.4, 0], [0, 0, -0.3, 0.15]], dtype=torch.float64
    )
    with torch.no_grad():
        logprobs = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    generator_logprobs = logprobs - log_ratio
    ref_logprobs = logprobs - 0.2
    advantages = torch.tensor([1.0, -0.5, 0.8], dtype=torch.float64)
    loss_fn = GRPOLoss(beta=0.1)

    def loss(x):
        return loss_fn(x, policy_batch(targets, advantages, generator_logprobs, mask, ref_logprobs)).loss

    assert torch.autograd.gradcheck(loss, (logits,))


def test_gspo_gradcheck():
    logits, targets, mask = gradcheck_logits(seed=1)
    with torch.no_grad():
        logprobs = torch.log_softmax(logits, -1).gather(-1, targets[..., None])[..., 0]
    # sequence ratios e^0.2 (clipped for A > 0), e^-0.03 (inside) and e^0.05 (inside)
    generator_logprobs = logprobs - torch.tensor(
        [[0.0, 0.2, 0.2, 0.2], [-0.03] * 4, [0.0, 0.0, 0.05, 0.05]], dtype=torch.float64
    )
    advantages = torch.tensor([1.0, -0.5, 0.8], dtype=torch.float64)
    loss_fn = GSPOLoss(clip_low=0.1, clip_high=0.1)

    def loss(x):
        return loss_fn(x, policy_batch(targets, advantages, generator_logprobs, mask)).loss

    assert torch.autograd.gradcheck(loss, (logits,))
    assert (
        loss_fn(logits, policy_batch(targets, advantages, generator_logprobs, mask)).metrics[
            "loss/clip_frac_high"
        ]
        > 0
    )


def test_cispo_gradcheck():
    """CISPO's weight is detached, so its loss value and its gradient disagree by design; holding
    the log-ratio fixed under perturbation (generator logprobs move with the trainer's) makes the
    weight a constant, and then finite differences must match autograd exactly."""
    logits, targets, mask = gradcheck_logits(seed=2)
    log_ratio = torch.tensor(
        [[0, 0.5, -0.1, 0.05], [-0.6, 0.1, 0.4, 0], [0, 0, -0.3, 0.15]], dtype=torch.float64
    )
    advantages = torch.tensor([1.0, -0.5, 0.8], dtype=torch.float64)
    loss_fn = CISPOLoss(clip_high=0.2)

    def loss(x):
        generator_logprobs = (
            torch.log_softmax(x, -1).gather(-1, targets[..., None])[..., 0].detach() - log_ratio
        )
        return loss_fn(x, policy_batch(targets, advantages, generator_logprobs, mask)).loss

    assert torch.autograd.gradcheck(loss, (logits,))


# --- masks --------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", [*LOSSES, "grpo_kl"])
def test_padded_positions_change_nothing(name):
    loss_fn = GRPOLoss(beta=0.1) if name == "grpo_kl" else build_loss(name)
    logits, targets, generator_logprobs, ref_logprobs = make_batch()
    advantages = TOKEN_ADVANTAGES.clone()

    def run(logits, targets, advantages, generator_logprobs, ref_logprobs):
        logits = logits.clone().requires_grad_()
        out = loss_fn(logits, policy_batch(targets, advantages, generator_logprobs, MASK, ref_logprobs))
        out.loss.backward()
        return out, logits.grad

    clean, clean_grad = run(logits, targets, advantages, generator_logprobs, ref_logprobs)
    padded = MASK == 0
    logits[padded] = torch.randn(int(padded.sum()), V, dtype=torch.float64) * 50
    targets[padded] = -100
    advantages[padded] = math.nan
    generator_logprobs[padded] = -math.inf
    ref_logprobs[padded] = math.nan
    dirty, dirty_grad = run(logits, targets, advantages, generator_logprobs, ref_logprobs)

    assert dirty.loss.item() == pytest.approx(clean.loss.item(), rel=1e-12, abs=1e-15)
    assert dirty.metrics == pytest.approx(clean.metrics, rel=1e-12, abs=1e-15)
    assert torch.isfinite(dirty_grad).all()
    assert (dirty_grad[padded] == 0).all()
    torch.testing.assert_close(dirty_grad[~padded], clean_grad[~padded], rtol=1e-12, atol=1e-15)


# --- construction, registry, errors -------------------------------------------------------------


def test_configs_reject_unknown_and_invalid_parameters():
    with pytest.raises(ValueError, match="clip_lo"):
        GRPOLoss(clip_lo=0.1)
    with pytest.raises(ValueError, match="beta"):
        build_loss("dapo", beta=0.1)  # DAPO has no KL term
    with pytest.raises(ValueError, match="horizon"):
        GRPOLoss(agg_type="token_mean", horizon=128)
    with pytest.raises(ValueError, match="agg_type"):
        GRPOLoss(agg_type="mean")
    with pytest.raises(ValueError, match="clip_low"):
        GRPOLoss(clip_low=1.5)
    with pytest.raises(ValueError, match="temperature"):
        CISPOLoss(temperature=0)


def test_losses_are_built_from_a_mapping_a_config_or_a_name():
    from_mapping = GRPOLoss.from_config({"clip_low": 0.1, "beta": 0.04})
    assert (from_mapping.config.clip_low, from_mapping.config.beta, from_mapping.config.clip_high) == (
        0.1,
        0.04,
        0.2,
    )
    assert GRPOLoss.from_config(GRPOLossConfig(beta=0.5)).config.beta == 0.5
    built = build_loss("dapo", clip_high=0.3)
    assert isinstance(built, DAPOLoss) and built.config.clip_high == 0.3
    assert repr(GSPOLoss()).startswith("GSPOLoss(agg_type='sequence_mean'")
    assert set(LOSSES) == {"grpo", "ppo", "dapo", "gspo", "cispo", "reinforce", "sft"}


def test_a_config_loss_section_is_the_named_losss_own_config():
    from pydantic import TypeAdapter

    from forge.rl.losses import LossConfig, loss_from_config

    sections = TypeAdapter(LossConfig)
    for name, loss_class in LOSSES.items():
        section = sections.validate_python({"name": name})
        assert type(section) is loss_class.config_class
        assert type(loss_from_config(section)) is loss_class
    assert sections.validate_python({"beta": 0.1}) == GRPOLossConfig(beta=0.1)
    with pytest.raises(ValueError, match="clip_lo"):
        sections.validate_python({"name": "grpo", "clip_lo": 0.1})


def test_build_loss_names_the_unknown_loss_and_the_known_ones():
    with pytest.raises(
        ValueError, match=r"unknown loss 'trpo'; known losses: grpo, dapo, gspo, ppo, cispo, reinforce, sft"
    ):
        build_loss("trpo")


def test_grpo_with_beta_needs_ref_logprobs():
    logits, targets, generator_logprobs, _ = make_batch()
    with pytest.raises(ValueError, match=r"GRPOLoss\(beta=0.1\) needs ref_logprobs"):
        GRPOLoss(beta=0.1)(logits, policy_batch(targets, SEQ_ADVANTAGES, generator_logprobs, MASK))


@pytest.mark.parametrize(
    ("field", "bad", "message"),
    [
        ("targets", torch.zeros(B, T + 1, dtype=torch.long), r"logits \(3, 5, 6\), target_ids \(3, 6\)"),
        ("mask", torch.ones(B, T + 1), r"target_ids \(3, 5\), loss_mask \(3, 6\)"),
        ("generator", torch.zeros(B, T - 1), r"logprobs \(3, 5\), generator_logprobs \(3, 4\)"),
        ("advantages", torch.zeros(B + 1), r"\[B, T\] = \(3, 5\), got \(4,\)"),
        ("ref", torch.zeros(B, 2), r"ref_logprobs \(3, 2\)"),
    ],
)
def test_policy_loss_shape_mismatch_names_the_shapes(field, bad, message):
    logits, targets, generator_logprobs, ref_logprobs = make_batch()
    inputs = {
        "targets": targets,
        "mask": MASK,
        "generator": generator_logprobs,
        "advantages": SEQ_ADVANTAGES,
        "ref": ref_logprobs,
    }
    inputs[field] = bad
    with pytest.raises(ValueError, match=message):
        GRPOLoss(beta=0.1)(
            logits,
            policy_batch(
                inputs["targets"], inputs["advantages"], inputs["generator"], inputs["mask"], inputs["ref"]
            ),
        )


def test_sft_shape_mismatch_names_the_shapes():
    logits, targets, _, _ = make_batch()
    with pytest.raises(ValueError, match=r"target_ids \(3, 5\), loss_mask \(3, 4\)"):
        SFTLoss()(logits, PolicyBatch(targets, MASK[:, :4]))


def test_loss_output_holds_detached_tensors_and_converts_them_once():
    logits, targets, generator_logprobs, _ = make_batch()
    out = GRPOLoss()(logits.requires_grad_(), policy_batch(targets, SEQ_ADVANTAGES, generator_logprobs, MASK))
    assert isinstance(out, LossOutput) and out.loss.requires_grad and out.loss.dim() == 0
    assert all(t.dim() == 0 and not t.requires_grad for t in out.metric_tensors.values())
    assert all(type(v) is float for v in out.metrics.values())
    assert out.metrics is out.metrics
