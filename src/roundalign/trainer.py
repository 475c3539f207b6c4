"""The trainer side: the HF model, and teacher-forced log-probs of sampled tokens as an RL trainer computes them.

An RL trainer (verl, TRL, OpenRLHF) takes each rollout, prompt + completion, runs its HF model over it in one
forward and reads the log-prob of every completion token from a full-vocabulary log-softmax of the bf16 logits.
``TrainerSide`` does exactly that, once per trainer profile: ``roundalign.apply(model, profile)`` sets where the
model rounds, and ``revert`` restores stock HF afterwards, so one bf16 model serves every profile.

Every sequence is its own forward, unpadded, as a trainer that removes padding (verl's ``use_remove_padding``,
packed sequences) sees it: padding would change matmul and attention shapes, which is a kernel effect the probe
measures separately (the engine's decode reference), not a rounding-location one.

The fp32 reference forward (an fp32 copy of the same bf16 weights, exact) gives the ground truth against which
the error correlation rho is computed, and the per-token entropy that shows how peaked the model is.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

import roundalign
from roundalign.engine.loader import read_config
from roundalign.errors import UserError
from roundalign.profiles import Profile, get_profile
from roundalign.rollouts import Rollout
from roundalign.support import check_trainer_model


def check_device(device: str) -> torch.device:
    """``device`` (``--device``) as a torch.device that exists here; a UserError naming the fix otherwise."""
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise UserError(f"--device {device!r} is not a torch device ({exc}); use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device} asked for a GPU, but torch sees none here; use --device cpu")
    return dev


def load_model(path: str | Path, dtype: torch.dtype = torch.bfloat16):
    """An HF causal LM from a model directory in ``dtype``, after the checks that give clear errors for what users
    get wrong: the directory and config (the engine loader's ``read_config``) and what ``roundalign.apply`` can
    patch (``roundalign.support``; it covers more families than the reference engine)."""
    import transformers

    path = Path(path)
    check_trainer_model(read_config(path))
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    except Exception as exc:  # missing or corrupt weights
        raise UserError(f"cannot load the weights in {str(path)!r}: {exc}") from exc


def load_trainer_model(path: str | Path):
    """The trainer's bf16 HF model for scoring: eval mode, no gradients."""
    return load_model(path, torch.bfloat16).eval().requires_grad_(False)


def completion_logits(model, prompt_ids: list[int], completion_ids: list[int]) -> torch.Tensor:
    """One teacher-forced forward over prompt + completion; the logits rows that predict each completion token."""
    ids = torch.tensor([*prompt_ids, *completion_ids], device=next(model.parameters()).device)
    return model(input_ids=ids[None]).logits[0, len(prompt_ids) - 1 : -1]


def completion_logprobs(logits: torch.Tensor, completion_ids, with_entropy: bool = False):
    """What a trainer computes from those rows: an fp32 full-vocabulary log-softmax, the log-prob of each completion
    token, and (``with_entropy``) the entropy in nats of every row."""
    logp = logits.float().log_softmax(-1)
    picked = logp.gather(-1, torch.as_tensor(completion_ids, device=logp.device)[:, None])[:, 0]
    if not with_entropy:
        return picked
    return picked, -(logp.exp() * logp).sum(-1)


class TrainerSide:
    """Teacher-forced log-probs and hidden states of one bf16 HF model under any trainer profile."""

    def __init__(self, model):
        if roundalign.patched_profile(model) is not None:
            raise ValueError(
                "the trainer model is patched once per profile here; pass an unpatched model (roundalign.revert(model))"
            )
        self.model = model.eval().requires_grad_(False)
        self._fp32 = None

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @contextlib.contextmanager
    def patched(self, profile: str | Profile):
        """The model patched with ``profile`` inside the block, stock HF again after it."""
        roundalign.apply(self.model, get_profile(profile))
        try:
            yield self.model
        finally:
            roundalign.revert(self.model)

    @staticmethod
    def token_logprobs(model, rollout: Rollout, with_entropy: bool = False):
        """The completion tokens' fp32 log-probs (and entropies) from one teacher-forced forward of ``model``.

        Runs on the model's device; the results come back on the CPU."""
        with torch.no_grad():
            logits = completion_logits(model, rollout.prompt_token_ids, rollout.token_ids)
        out = completion_logprobs(logits, rollout.token_ids, with_entropy)
        return tuple(t.cpu() for t in out) if with_entropy else out.cpu()

    @staticmethod
    def decode_logprobs(model, rollout: Rollout) -> torch.Tensor:
        """The completion tokens' fp32 log-probs computed as a sampler computes them: the prompt in one forward
        (logits of its last row only), then one token per forward over HF's KV cache.

        Same model, same rounding points as ``token_logprobs``, other kernel shapes: every GEMM has one row and
        attention one query. What this changes on a given CPU or GPU is what kernels alone do to the log-probs
        there (``roundalign fit``'s model check uses it as the reference for decode dumps)."""
        ids = rollout.ids.to(next(model.parameters()).device)
        n = len(rollout.prompt_token_ids)
        with torch.no_grad():
            out = model(input_ids=ids[None, :n], use_cache=True, logits_to_keep=1)
            rows = [out.logits[0, -1]]
            for t in range(n, len(ids) - 1):
                out = model(input_ids=ids[None, t : t + 1], cache=out.past_key_values, use_cache=True)
                rows.append(out.logits[0, -1])
        logp = torch.stack(rows).float().log_softmax(-1)
        return logp.gather(-1, ids[n:, None])[:, 0].cpu()

    def logprobs(self, profile: str | Profile, rollouts: list[Rollout]) -> list[torch.Tensor]:
        """Each rollout's completion-token log-probs (fp32, 1-D) with the model patched to ``profile``."""
        with self.patched(profile) as model:
            return [self.token_logprobs(model, r) for r in rollouts]

    def fp32_logprobs(self, rollouts: list[Rollout]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Log-probs and entropies (nats) from the fp32 reference forward: the same weights, no bf16 rounding."""
        if self._fp32 is None:
            self._fp32 = copy.deepcopy(self.model).float()  # bf16 -> fp32 is exact: the same weights
        out = [self.token_logprobs(self._fp32, r, with_entropy=True) for r in rollouts]
        return [lp for lp, _ in out], [h for _, h in out]

    def hidden_states(self, profile: str | Profile, token_ids: list[int]) -> list[torch.Tensor]:
        """The residual stream after every decoder layer (bf16, tokens x hidden), before the final norm.

        Read with forward hooks on the decoder layers rather than ``output_hidden_states``, whose last entry is
        after the final norm. A patched layer under an fp32-sum rule returns ``(R, S)``; ``R = r(S)`` is recorded,
        the bf16 tensor stock HF records.
        """
        seen: list[torch.Tensor] = []

        def hook(_module, _args, output):
            out = output[0] if isinstance(output, tuple) else output
            seen.append(out[0].detach().cpu().clone())

        with self.patched(profile) as model:
            handles = [layer.register_forward_hook(hook) for layer in model.model.layers]
            try:
                with torch.no_grad():
                    model(input_ids=torch.tensor([token_ids], dtype=torch.long, device=self.device))
            finally:
                for h in handles:
                    h.remove()
        return seen
