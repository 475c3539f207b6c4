"""roundalign.integrations.trl_osol inside a real TRL 1.16 GRPOTrainer, on the CPU, on the shipped tiny-qwen3.

Three steps of GRPO over two domains (arithmetic of level 1 and of level 3, a ``domain`` column), TRL sampling
itself (``model.generate``), with ``OsolAdvantage`` attached. What the loss received (``_compute_loss``'s
``inputs["advantages"]``, rows matched by their tokens after TRL's shuffle) is checked against references the test
builds itself:

- batch 1: TRL's own per-sequence advantages (read before the hook) weighted by ``base_advantages`` and broadcast
  over each completion's tokens: no footprint yet;
- batches 2 and 3: ``corrected_advantages`` on a footprint recomputed here: the focus completions scored by TRL's
  scoring call under the weights a callback saved at the start of the previous step, minus under those of this step;
- the weights are back bit for bit after the hook's footprint, and the osol/* metrics reach TRL's log;
- misuse is refused: a missing column, an unknown domain, one domain, settings OSOL cannot use.

Everything compared runs the same code on the same inputs (one torch thread), so every comparison is exact.
"""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

import trl_setup
from roundalign.integrations.trl_osol import OsolAdvantage
from roundalign.rl.osol import base_advantages, corrected_advantages, focus_domain

DOMAINS = ["easy", "hard"]
STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-core machine shared with other jobs; and one reduction order for exact equality
    yield
    torch.set_num_threads(threads)


def two_domains(n: int = 8, unknown: str | None = None):
    """Arithmetic prompts of level 1 ("easy") and level 3 ("hard"), interleaved, with a ``domain`` column."""
    import datasets

    from roundalign.tasks import format_prompt, make_problems

    rows = []
    for easy, hard in zip(make_problems(n, level=1, seed=1), make_problems(n, level=3, seed=2), strict=True):
        rows += [(easy, "easy"), (hard, unknown or "hard")]
    return datasets.Dataset.from_dict(
        {
            "prompt": [format_prompt(p) for p, _ in rows],
            "answer": [p.answer for p, _ in rows],
            "domain": [d for _, d in rows],
        }
    )


def reward_digits(prompts, completions, **kwargs):
    """The share of digits in a completion: differs between nearly any two samples, so every group has a gradient."""
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


def build(tmp_path, steps: int = STEPS, dataset=None):
    model, tokenizer = trl_setup.policy(fp32=True)  # fp32 parameters under bf16 autocast: TRL's usual setup
    # A hot temperature: the tiny model is sure of itself, and a group of identical samples has no advantage.
    return trl_setup.trainer(
        model, tokenizer, str(tmp_path), steps=steps, generations=4, per_device_train_batch_size=16,
        max_completion_length=12, temperature=2.0, rewards=(trl_setup.reward_exact, reward_digits),
        train_dataset=two_domains() if dataset is None else dataset,
    )  # fmt: skip


def _trainable(trainer) -> dict[str, torch.Tensor]:
    return {n: p for n, p in trainer.accelerator.unwrap_model(trainer.model).named_parameters() if p.requires_grad}


class Recorder(TrainerCallback):
    """The weights at the start of every step (before its generation), TRL's batches before and after the hook,
    and what the loss received."""

    def __init__(self, trainer, osol: OsolAdvantage):
        self.trainer, self.weights, self.batches, self.losses, self.restored = trainer, [], [], [], []
        trl_inner = trainer._generate_and_score_completions  # TRL's own, before the hook

        def before_hook(inputs):
            output = trl_inner(inputs)
            self.batches.append(
                {
                    "trl_advantages": output["advantages"].clone(),
                    "domains": [DOMAINS.index(row["domain"]) for row in inputs],
                    **{
                        k: output[k].clone() for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask")
                    },
                }
            )
            return output

        trainer._generate_and_score_completions = before_hook
        osol.attach(trainer)
        hooked = trainer._generate_and_score_completions

        def after_hook(inputs):
            output = hooked(inputs)
            live = _trainable(trainer)
            self.restored.append(all(torch.equal(live[n], w) for n, w in self.weights[-1].items()))
            return output

        trainer._generate_and_score_completions = after_hook
        loss = trainer._compute_loss

        def compute_loss(model, inputs):
            self.losses.append({k: inputs[k].clone() for k in ("advantages", "prompt_ids", "completion_ids")})
            return loss(model, inputs)

        trainer._compute_loss = compute_loss
        trainer.add_callback(self)

    def on_step_begin(self, args, state, control, **kwargs):
        self.weights.append({n: p.detach().clone() for n, p in _trainable(self.trainer).items()})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    trainer = build(tmp_path_factory.mktemp("osol"))
    osol = OsolAdvantage(DOMAINS, domain_column="domain")
    recorder = Recorder(trainer, osol)
    trainer.train()
    return trainer, osol, recorder


def _key(prompt_ids: torch.Tensor, completion_ids: torch.Tensor) -> tuple:
    return tuple(prompt_ids.tolist()) + (-1,) + tuple(completion_ids.tolist())


def _received(batch: dict, loss: dict) -> torch.Tensor:
    """The loss's (B, T) advantages, put back in the generation batch's row order (TRL shuffles the rows)."""
    rows = {}
    for i, key in enumerate(map(_key, loss["prompt_ids"], loss["completion_ids"])):
        rows.setdefault(key, []).append(i)
    order = [rows[_key(p, c)].pop() for p, c in zip(batch["prompt_ids"], batch["completion_ids"], strict=True)]
    return loss["advantages"][order]


def _logps(trainer, batch: dict, rows: torch.Tensor, weights: dict) -> torch.Tensor:
    """The focus rows' log-probs by TRL's scoring call, with ``weights`` copied into the live policy."""
    live = _trainable(trainer)
    with torch.no_grad():
        for n, w in weights.items():
            live[n].copy_(w)
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], dim=1)[rows]
        attention = torch.cat([batch["prompt_mask"], batch["completion_mask"]], dim=1)[rows]
        return trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, attention, batch["completion_ids"].size(1), batch_size=16
        )[0]


def _base(batch: dict, step: int) -> tuple[int, torch.Tensor]:
    focus = focus_domain(len(DOMAINS), 0, step)  # args.seed = 0
    base = base_advantages(batch["trl_advantages"], batch["domains"], focus, 1.0, 0.5)
    return focus, base[:, None].expand(batch["completion_mask"].shape).clone()


def test_first_batch_gets_the_domain_weighted_trl_advantages(run):
    trainer, _, rec = run
    assert len(rec.batches) == len(rec.losses) == STEPS
    batch = rec.batches[0]
    _, base = _base(batch, 1)
    mask = batch["completion_mask"].bool()
    received = _received(batch, rec.losses[0])
    assert received.shape == mask.shape  # per token, (B, T)
    assert base.abs().max() < 3.0  # the clip does not bind: the expectation is the weighted advantage itself
    assert torch.equal(received, torch.where(mask, base, 0.0))
    assert trainer.state.log_history[0]["osol/kappa"] is None  # no previous update, no footprint


def test_later_batches_get_the_footprint_corrected_advantages(run):
    trainer, _, rec = run
    trainer.model.train()  # the mode the hook scored in (the tiny model has no dropout either way)
    moved = 0
    for k in range(2, STEPS + 1):
        batch, log = rec.batches[k - 1], trl_setup.step_logs(trainer)[k - 1]
        focus, base = _base(batch, k)
        rows = torch.tensor([d == focus for d in batch["domains"]])
        assert rows.any() and not rows.all(), "the run must mix both domains in this batch for a real check"
        idx = rows.nonzero().flatten()
        # The footprint of the last update, recomputed here from the weights the callback saved.
        u = torch.zeros(batch["completion_mask"].shape)
        u[idx] = (
            _logps(trainer, batch, idx, rec.weights[k - 1]) - _logps(trainer, batch, idx, rec.weights[k - 2])
        ).float()
        mask = batch["completion_mask"].bool()
        expected = corrected_advantages(base, mask, rows, u)  # roundalign train's defaults, as OsolAdvantage's
        assert torch.equal(_received(batch, rec.losses[k - 1]), expected.advantages)
        assert expected.candidates > 0 and expected.kappa > 0  # the weights moved: there is a footprint to rank
        moved += int((expected.advantages != torch.where(mask, base, 0.0)).sum())
        assert log["osol/focus_domain"] == focus
        assert log["osol/candidates"] == expected.candidates and log["osol/focus_tokens"] == expected.focus_tokens
        # TRL logs the mean of the step's one value: the value itself
        assert log["osol/kappa"] == expected.kappa and log["osol/residual_share"] == expected.residual_share
    assert moved > 0  # the residual changed some token's advantage


def test_the_hook_puts_the_live_weights_back_bit_for_bit(run):
    _, osol, rec = run
    assert rec.restored == [True] * STEPS
    assert osol.step == STEPS and osol.previous is not None


# ----------------------------------------------------------------------------------------------------------------
# refused


def test_unknown_domain_is_refused_during_training(tmp_path):
    trainer = build(tmp_path, steps=1, dataset=two_domains(unknown="poetry"))
    OsolAdvantage(DOMAINS).attach(trainer)
    with pytest.raises(ValueError, match=r"unknown domain 'poetry' in column 'domain'.*'easy', 'hard'"):
        trainer.train()


def test_missing_column_and_settings_are_refused(tmp_path):
    trainer = build(tmp_path, steps=1)
    with pytest.raises(ValueError, match="at least 2"):
        OsolAdvantage(["easy"])
    with pytest.raises(ValueError, match="no 'topic' column"):
        OsolAdvantage(DOMAINS, domain_column="topic").attach(trainer)
    with pytest.raises(ValueError, match="no 'domain' column"):  # a dataset without column names: the row says so
        OsolAdvantage(DOMAINS)._domains([{"prompt": "1 + 1 ="}])
    trainer.loss_type = "vespo"
    with pytest.raises(ValueError, match="loss_type='vespo'.*one per sequence"):
        OsolAdvantage(DOMAINS).attach(trainer)
    trainer.loss_type = "dapo"
    trainer.args.off_policy_mask_threshold = 0.5
    with pytest.raises(ValueError, match="off_policy_mask_threshold"):
        OsolAdvantage(DOMAINS).attach(trainer)
    trainer.args.off_policy_mask_threshold = None
    trainer.args.remove_unused_columns = True
    with pytest.raises(ValueError, match="remove_unused_columns=False"):
        OsolAdvantage(DOMAINS).attach(trainer)
