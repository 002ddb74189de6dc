"""``train.grpo``: GRPO on prompts with a verifiable answer (``model.task: grpo``) with TRL 1.16's ``GRPOConfig``
names and defaults (:mod:`onegpu.training.objectives.grpo`), and what a GRPO run does not combine with yet
(:func:`check_grpo`)."""
from __future__ import annotations

from dataclasses import dataclass

from onegpu.config.knobs import IN_KEY, POSITIVE_INT, fail, knob, one_of

GRPO_LOSS_TYPES = ("dapo", "dr_grpo", "grpo", "bnpo")  # TRL's names; dapo is its default
SCALE_REWARDS = ("group", "batch", "none")  # TRL's scale_rewards


def _names(v) -> bool:
    return bool(v) and all(isinstance(x, str) and x.strip() for x in v) and len(set(v)) == len(v)


@dataclass
class GRPOConfig:
    """``train.grpo``: each optimizer step samples ``num_generations`` completions per prompt, scores them with
    the reward functions and trains on their group-relative advantages. In the equivalence key of GRPO runs
    only. ``train.per_device_train_batch_size`` counts completions, as in TRL."""
    num_generations: int = knob(8, key=IN_KEY, help="completions sampled per prompt (the group), at least 2",
                                rule=(lambda v: v >= 2, "must be an integer of at least 2 (a group), got {v}"))
    max_completion_length: int = knob(256, key=IN_KEY, help="tokens a completion may have (TRL's)",
                                      rule=POSITIVE_INT)
    temperature: float = knob(1.0, key=IN_KEY, help="sampling temperature; the log-probabilities use it too",
                              rule=(lambda v: v > 0, "must be a positive number, got {v}"))
    top_p: float = knob(1.0, key=IN_KEY, help="nucleus sampling; 1.0 = off",
                        rule=(lambda v: 0 < v <= 1, "must be in (0, 1], got {v}"))
    top_k: int = knob(0, key=IN_KEY, help="top-k sampling; 0 = off",
                      rule=(lambda v: v >= 0, "must be an integer >= 0 (0 = off), got {v}"))
    loss_type: str = knob("dapo", key=IN_KEY, help=" | ".join(GRPO_LOSS_TYPES) + " (TRL's; bnpo depends on the split)",
                          rule=one_of(GRPO_LOSS_TYPES))
    epsilon: float = knob(0.2, key=IN_KEY, help="the clip range's lower side (and upper, unless epsilon_high)",
                          rule=(lambda v: v > 0, "must be a positive number, got {v}"))
    epsilon_high: float | None = knob(None, key=IN_KEY, help="the clip range's upper side; null = epsilon", rule=(
        lambda v: v is None or v > 0, "must be null or a positive number, got {v}"))
    beta: float = knob(0.0, key=IN_KEY, help="the KL coefficient to the reference; 0 = no reference (TRL's default)",
                       rule=(lambda v: v >= 0, "must be a number >= 0, got {v}"))
    scale_rewards: str = knob("group", key=IN_KEY, help=" | ".join(SCALE_REWARDS) + ": what divides the advantages",
                              rule=one_of(SCALE_REWARDS))
    num_iterations: int = knob(1, key=IN_KEY, help="optimizer steps per generation batch (TRL's)",
                               rule=POSITIVE_INT)
    use_bias_correction_kl: bool = knob(True, key=IN_KEY,
                                        help="the KL term times the importance ratio (TRL's default)")
    reward_funcs: list[str] = knob(default_factory=lambda: ["correctness"], key=IN_KEY, help=(
        "correctness | answer_mentioned | think_format | package.module:function (TRL's signature); summed"),
        rule=(_names, "must be a non-empty list of distinct names, got {v}"))
    reward_weights: list[float] | None = knob(None, key=IN_KEY, help="one weight per reward function; null = 1 each")


# train.* or data.* with a GRPO run: (the key, it is set, why not yet and what to set), one line each, in order.
_REFUSALS = (
    ("train.per_device_train_batch_size", lambda c: c.train.per_device_train_batch_size == "auto",
     "auto probes micro-batches of training rows, and a GRPO micro-batch is completions sampled in the step; "
     "give an integer (completions per micro-batch, as TRL counts them)"),
    ("train.num_processes", lambda c: c.train.num_processes > 1,
     "a group's rewards across processes are not gathered yet; set train.num_processes: 1"),
    ("train.torch_compile", lambda c: c.train.torch_compile,
     "generation under torch.compile is not proven yet; set train.torch_compile: false"),
    ("train.grpo.beta", lambda c: c.train.grpo.beta != 0.0,
     "the reference model of GRPO's KL term is not wired yet; set train.grpo.beta: 0 (TRL's default)"),
    ("train.grpo.num_iterations", lambda c: c.train.grpo.num_iterations > 1,
     "reusing a generation batch over several optimizer steps is not wired yet; set train.grpo.num_iterations: 1"),
    ("data.padding_free", lambda c: c.data.padding_free,
     "a GRPO micro-batch is left-padded prompts and their completions; set data.padding_free: false"),
)


def check_grpo(cfg, source: str) -> None:
    """``train.grpo`` against itself, and a ``model.task: grpo`` run against the batch layout: the step's
    completions (micro-batch x accumulation x processes) whole groups of ``num_generations`` (TRL's rule), one
    weight per reward function, nothing of :data:`_REFUSALS`."""
    g, t = cfg.train.grpo, cfg.train
    if g.reward_weights is not None and len(g.reward_weights) != len(g.reward_funcs):
        fail(source, "train.grpo.reward_weights", f"has {len(g.reward_weights)} weights for {len(g.reward_funcs)} "
              f"reward functions ({', '.join(g.reward_funcs)}); give one per function or null")
    if cfg.model.task != "grpo":
        return
    for key, bad, problem in _REFUSALS:
        if bad(cfg):
            fail(source, key, f"is {_value(cfg, key)!r} with model.task: grpo: {problem}")
    step = t.per_device_train_batch_size * t.gradient_accumulation_steps * t.num_processes
    if step % g.num_generations:
        fail(source, "train.grpo.num_generations", f"is {g.num_generations}, but an optimizer step holds "
              f"{t.per_device_train_batch_size} x {t.gradient_accumulation_steps} x {t.num_processes} = {step} "
              "completions (micro-batch x accumulation x processes), not whole groups; make the step a multiple of "
              "num_generations (TRL's rule)")


def _value(cfg, key: str):
    value = cfg
    for part in key.split("."):
        value = getattr(value, part)
    return value
