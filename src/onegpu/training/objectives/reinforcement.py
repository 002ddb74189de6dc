"""Reinforcement learning from verifiable rewards (``model.task: grpo``): GRPO on prompts with an answer
(:mod:`onegpu.data.prompt_answer`), TRL 1.16's ``GRPOTrainer`` semantics and names.

The training rows are the prompts, each a ``row`` index alone. :class:`GroupSampler` draws every prompt
``num_generations`` times in a row (TRL's ``RepeatSampler``), so ``train.per_device_train_batch_size`` counts
completions as in TRL and a step of whole groups (``check_grpo``'s rule) holds its prompts' every draw. At each
optimizer step :meth:`GRPO.step_batches` samples the step's completions from the policy, scores them and gives
them advantages over whole groups (:func:`onegpu.training.objectives.grpo_batch.build`) before they are cut into
micro-batches of the sizes drawn; each micro-batch's loss is its share of the whole step's
(:func:`onegpu.training.objectives.grpo_batch.micro_batch_loss`), so the step is the same for any split. What the
objective keeps per model (the training prompts, the tokenizer, the settings, the reward functions, the current
step's generations) is a :class:`Run`, set when the model is built and its data prepared.
"""
from __future__ import annotations

import time
import weakref
from dataclasses import dataclass, field

from onegpu.data.chat import last_text as chat_text
from onegpu.training.objectives import generation, grpo_batch, lm_head, rewards
from onegpu.training.objectives.base import Objective

ROW = "row"  # the training rows' one column: the prompt's index in its split
GRPO_ROWS = "grpo_rows"  # a micro-batch's rows of the step's generations
COMPLETIONS_TABLE = "completions.json"  # the run's table of sampled completions (MLflow's log_table)


def settings_of(cfg) -> grpo_batch.Settings:
    """``train.grpo`` as :class:`~onegpu.training.objectives.grpo_batch.Settings`."""
    g = cfg.train.grpo
    return grpo_batch.Settings(
        generation.Sampling(g.num_generations, g.max_completion_length, g.temperature, g.top_p, g.top_k),
        g.loss_type, g.epsilon, g.epsilon_high, g.beta, g.scale_rewards, g.num_iterations, g.use_bias_correction_kl,
        tuple(g.reward_weights) if g.reward_weights is not None else None)


def reward_funcs(cfg) -> dict:
    """``train.grpo.reward_funcs`` resolved (:func:`onegpu.training.objectives.rewards.resolve`), by the name TRL
    logs them under, each function's ``__name__`` (the params' names where two functions share one).

    Raises:
        ConfigError: a name that is no reward function (one line).
    """
    funcs = {name: rewards.resolve(name) for name in cfg.train.grpo.reward_funcs}
    short = [getattr(fn, "__name__", name) for name, fn in funcs.items()]
    return dict(zip(short, funcs.values())) if len(set(short)) == len(short) else funcs


class GroupSampler:
    """Indices ``0 .. rows - 1`` in an order shuffled per epoch (a ``torch.Generator`` seeded ``seed + epoch``),
    each repeated ``num_generations`` times in a row: TRL's ``RepeatSampler`` with ``mini_repeat_count =
    num_generations`` and ``batch_size`` 1, seeded per epoch (``set_epoch``, which Accelerate's loaders and
    Trainer call) rather than from one generator's running state, so that a resumed epoch draws the same order."""

    def __init__(self, rows: int, num_generations: int, seed: int) -> None:
        self.rows, self.num_generations, self.seed, self.epoch = rows, num_generations, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.rows * self.num_generations

    def __iter__(self):
        import torch
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        for i in torch.randperm(self.rows, generator=generator).tolist():
            yield from (i,) * self.num_generations


class RowCollator:
    """Rows -> ``{"row": (rows,) int64}``: the prompts' indices (the step's generations make the tensors)."""

    def __call__(self, rows: list[dict]) -> dict:
        import torch
        return {ROW: torch.tensor([r[ROW] for r in rows], dtype=torch.long)}


@dataclass
class Run:
    """What :class:`GRPO` keeps for one policy: the training prompts (``prompts``, their other ``columns`` and
    ``prompt_ids``), the tokenizer's ids and decoding, the settings, the reward functions and the generation
    seed; then the current step's :class:`~onegpu.training.objectives.grpo_batch.StepBatch`, its counts and its
    figures so far."""
    settings: grpo_batch.Settings
    funcs: dict
    seed: int
    prompts: list = field(default_factory=list)
    columns: dict = field(default_factory=dict)
    prompt_ids: list = field(default_factory=list)
    tokenizer: object = None
    batch: object = None
    counts: object = None
    figures: object = None
    generation_s: float = 0.0  # the current step's sampling and scoring time (s)
    logging_steps: int = 1
    table: dict = field(default_factory=dict)  # the sampled completions of the logging steps (COMPLETIONS_TABLE)


_RUNS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # the policy's transformers model -> its Run


def run_of(model) -> Run:
    """The :class:`Run` :meth:`GRPO.prepare_model` set for ``model`` (wrapped or not).

    Raises:
        RuntimeError: none was set (a model not built by ``session.build_model``).
    """
    run = _RUNS.get(lm_head._inner(getattr(model, "module", model)))
    if run is None:
        raise RuntimeError("this model has no GRPO state: build it with onegpu.training.session.build_model")
    return run


def _decode(tokenizer):
    return lambda ids: tokenizer.decode(ids, skip_special_tokens=True)


def _micro_batches(batch, sizes: list[int]) -> list[dict]:
    """The step's generations cut into micro-batches of ``sizes`` rows: the prompt and completion tokens, their
    mask, ``labels`` (the completion tokens, -100 elsewhere: what the step counts) and ``grpo_rows`` (their rows of
    the step's generations: an index tensor, so that an out-of-memory retry's cut carries it)."""
    import torch
    g = batch.gens
    ids = torch.cat([g.prompt_ids, g.completion_ids], dim=1)
    mask = torch.cat([g.prompt_mask, g.completion_mask], dim=1)
    labels = torch.cat([torch.full_like(g.prompt_ids, -100), g.completion_ids.masked_fill(g.completion_mask == 0,
                                                                                         -100)], dim=1)
    out, start = [], 0
    for n in sizes:
        rows = slice(start, start + n)
        out.append({"input_ids": ids[rows], "attention_mask": mask[rows], "labels": labels[rows],
                    GRPO_ROWS: torch.arange(start, start + n, device=ids.device)})
        start += n
    return out


def _add_rows(run: Run, step: int, prompts: list[int]) -> None:
    """The step's completions as rows of :data:`COMPLETIONS_TABLE`: step, prompt, completion, each reward
    function's score, the reward and the advantage (TRL's completions table's columns)."""
    b, g = run.batch, run.settings.sampling.num_generations
    columns = {"step": [step] * b.rows, "prompt": [chat_text(run.prompts[i]) for i in prompts for _ in range(g)],
               "completion": list(b.texts), **{name: b.per_func[:, j].tolist() for j, name in enumerate(b.names)},
               "reward": b.total.tolist(), "advantage": b.advantages.double().tolist()}
    merged = {k: run.table.get(k, []) + v for k, v in columns.items()}  # in this column order, also after a resume
    run.table.clear()  # (in place: the recorder holds this dict, StepRecorder.tables)
    run.table.update(merged)


class GRPO(Objective):
    task = "grpo"
    own_forward = True
    probes_activations = False  # the rows are indices; the step's memory is its generations' (not probed yet)
    not_measured_yet = ("a GRPO step's time and memory are mostly its generations' (sampled inside the step), which "
                        "neither the estimate nor the tradeoffs rows model; train with an integer "
                        "train.per_device_train_batch_size and read the run's generation_seconds and peak in MLflow")

    def sampler(self, rows, cfg):
        """:class:`GroupSampler` over ``rows``, seeded ``train.seed``."""
        return GroupSampler(len(rows), cfg.train.grpo.num_generations, cfg.train.seed)

    def start_words(self, cfg) -> tuple[str, str]:
        """A step's items are completions; the rows are prompts, each drawn ``num_generations`` times."""
        return "completions", f"training prompts ({cfg.train.grpo.num_generations} completions each an epoch)"

    def prepare_model(self, model, cfg) -> None:
        """The policy's :class:`Run`: the settings and the reward functions, resolved before any step.

        Raises:
            ConfigError: a reward function that cannot be found (one line)."""
        _RUNS[lm_head._inner(model)] = Run(settings_of(cfg), reward_funcs(cfg), cfg.train.seed,
                                           logging_steps=cfg.train.logging_steps)

    def prepared_data(self, dsd, model, tokenizer, cfg):
        """``dsd`` as it is; the training split's prompts, answers and prompt ids kept in the policy's :class:`Run`."""
        run, train = run_of(model), dsd["train"]
        run.prompts, run.prompt_ids, run.tokenizer = train["prompt"], train["prompt_ids"], tokenizer
        run.columns = {"answer": train["answer"]}
        return dsd

    def step_batches(self, model, micro_batches: list[dict], step: int) -> list[dict]:
        """The step's prompts (every ``num_generations``-th drawn row) sampled, scored and given their advantages
        over whole groups (seed ``train.seed`` and ``step``), then cut into micro-batches of the sizes drawn.

        Raises:
            RuntimeError: the drawn rows are not whole groups in a row (a sampler other than :class:`GroupSampler`).
        """
        run = run_of(model)
        start, s = time.perf_counter(), run.settings
        sizes, g = [int(b[ROW].shape[0]) for b in micro_batches], s.sampling.num_generations
        drawn = [i for b in micro_batches for i in b[ROW].tolist()]
        if len(drawn) % g or any(drawn[k] != drawn[k - k % g] for k in range(len(drawn))):
            raise RuntimeError(f"optimizer step {step} drew {drawn}: not whole groups of {g} (GroupSampler's order)")
        rows = drawn[::g]
        tok, policy = run.tokenizer, lm_head._inner(getattr(model, "module", model))
        run.batch = grpo_batch.build(
            getattr(model, "module", model), [run.prompts[i] for i in rows], [run.prompt_ids[i] for i in rows],
            {k: [v[i] for i in rows] for k, v in run.columns.items()}, run.funcs, s, _decode(tok), tok.pad_token_id,
            generation.eos_ids(tok, policy), run.seed * 1_000_003 + step)
        out = _micro_batches(run.batch, sizes)
        run.counts = grpo_batch.counts(run.batch, [b[GRPO_ROWS] for b in out])
        run.figures, run.generation_s = grpo_batch.Figures(), time.perf_counter() - start
        if step == 1 or step % run.logging_steps == 0:
            _add_rows(run, step, rows)
        return out

    def count_batch(self, inputs: dict):
        """Completion tokens of a micro-batch (its ``labels`` other than -100): a 0-dim int64 tensor."""
        return inputs["labels"].ne(-100).sum()

    def count_items(self, labels):
        return labels.ne(-100).sum()

    def step_loss(self, model, inputs: dict, num_items):
        """The micro-batch's share of the step's loss under ``train.grpo.loss_type`` (the step's own counts)."""
        run = run_of(model)
        return grpo_batch.micro_batch_loss(model, run.batch, inputs[GRPO_ROWS], run.counts, run.settings,
                                           run.figures)

    def step_figures(self, model):
        """A callable giving TRL's per-step figures over the whole step (``reward``, ``reward_std``,
        ``rewards/<name>/mean``, ``completions/*``, ``clip_ratio/*``, ``kl`` when ``beta`` is not 0) and the
        step's ``generation_seconds``; one host read."""
        run = run_of(model)

        def take() -> dict:
            if run.batch is None:
                return {}
            out = grpo_batch.step_figures(run.batch, run.settings.sampling.num_generations)
            out.update(run.figures.values(run.settings.beta))
            out["generation_seconds"] = run.generation_s
            run.batch = None
            return out
        return take

    def run_tables(self, model) -> dict[str, dict[str, list]]:
        """:data:`COMPLETIONS_TABLE`: the completions sampled at step 1 and every ``train.logging_steps``-th step
        (the live dict the step appends to)."""
        return {COMPLETIONS_TABLE: run_of(model).table}

    def restart_step(self, model) -> None:
        run_of(model).figures = grpo_batch.Figures()

    def model_inputs(self, dsd):
        """Each split's rows as their index (``row``) alone."""
        from datasets import Dataset, DatasetDict
        if hasattr(dsd, "features"):
            return Dataset.from_dict({ROW: list(range(len(dsd)))})
        return DatasetDict({s: Dataset.from_dict({ROW: list(range(len(d)))}) for s, d in dsd.items()})

    def collator(self, tokenizer, flattened: bool = False):
        return RowCollator()

    def heldout_metrics(self, model, tokenizer, dataset, cfg, device: str, prefix: str) -> dict:
        """The split's prompts answered greedily (one completion each, ``max_completion_length``): ``pass_rate``
        (the share whose final answer is the row's, :func:`~onegpu.training.objectives.rewards.correctness`),
        ``reward`` (the mean of the reward functions' weighted sum), ``completions/mean_length`` (tokens),
        ``prompts``, ``runtime`` (s), each under ``prefix``."""
        from onegpu.training.objectives import heldout_generation
        return heldout_generation.figures(model, tokenizer, dataset, cfg, device, prefix, reward_funcs(cfg))

    def test_figures(self, model, tokenizer, dataset, cfg, device: str) -> tuple[dict, list[int], list[int]]:
        """:meth:`heldout_metrics` of the trained ``model`` and the starting model's own ``pass_rate`` and
        ``reward`` (``test_start_*``: :func:`onegpu.training.objectives.precomputed.initial_model`)."""
        from onegpu.training.objectives import heldout, precomputed
        out = self.heldout_metrics(model, tokenizer, dataset, cfg, device, heldout.TEST)
        start = self.heldout_metrics(precomputed.initial_model(cfg, tokenizer), tokenizer, dataset, cfg, device,
                                     heldout.TEST)
        out.update({f"{heldout.TEST}_start_{k}": start[f"{heldout.TEST}_{k}"] for k in ("pass_rate", "reward")})
        return out, [], []

    def result_line(self, metrics: dict) -> str:
        m = metrics
        return (f"pass rate {m['test_pass_rate']:.3f} against the starting model's {m['test_start_pass_rate']:.3f} "
                f"(greedy answers whose final answer is the row's), reward {m['test_reward']:.3f} against "
                f"{m['test_start_reward']:.3f}, on {m['test_prompts']} test prompts")


OBJECTIVE = GRPO()
