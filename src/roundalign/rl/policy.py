"""The trainer side of a run: fp32 master weights, a 16-bit compute copy under a rounding profile, the optimizer.

This is the numerics production trainers use (verl's actor: fp32 parameters, FSDP ``MixedPrecision(param_dtype=
bf16)``): the optimizer updates fp32 master weights, and every forward and backward runs on a bf16 (or fp16) copy
of them. The copy is an HF model patched with ``roundalign.apply(model, trainer_profile)``, so the trainer profile
decides where its activations round, exactly as in the probe.

Each step the copy is refreshed from the master in one of two ways (``set_compute_weights``):

- the RNE cast ``master.to(bf16)``: what FSDP's mixed precision does, and what the engine serves under
  ``--sync rne``, so trainer and engine hold bit-identical weights;
- the served copy itself (``--loss-on-served``): under stochastic or error-feedback export the engine serves
  weights that differ from ``master.to(bf16)``, and Fair Cast computes the loss on those, so that trainer and engine
  again agree on the weights; the gradient still updates the fp32 master.

Gradients: each sequence is its own micro-batch (no padding, the shapes the engine's prefill uses, docs/train.md).
Its 16-bit parameter gradients are added into fp32 master gradients, as FSDP reduces gradients in fp32
(``reduce_dtype``). fp16 runs scale the loss with ``torch.amp.GradScaler`` (dynamic, verl's growth interval 400).
"""

from __future__ import annotations

from pathlib import Path

import torch

import roundalign
from roundalign.numerics import dtypes
from roundalign.rl.config import TrainConfig
from roundalign.trainer import completion_logits, completion_logprobs, load_model


class NonFiniteError(RuntimeError):
    """A non-finite loss or gradient; the message names the step and the quantity."""


class Policy:
    def __init__(self, model_dir: Path, config: TrainConfig):
        self.config = config
        self.dtype = dtypes.BY_NAME[config.dtype]
        model = load_model(model_dir, torch.float32)
        # The master is the checkpoint upcast to fp32 (exact for a bf16 checkpoint); the compute copy starts as its
        # RNE cast, i.e. the checkpoint itself.
        self.master = {n: torch.nn.Parameter(p.detach().clone()) for n, p in model.named_parameters()}
        self.model = model.to(self.dtype).train()
        self.model.config.use_cache = False
        roundalign.apply(self.model, config.resolved_trainer_profile, allow_non_bf16=self.dtype != torch.bfloat16)
        self._compute = dict(self.model.named_parameters())
        self.scheme = config.served_scheme  # what a served copy given to set_compute_weights is quantized in
        params = list(self.master.values())
        if config.optimizer == "adamw":
            self.optimizer = torch.optim.AdamW(
                params, lr=config.lr, betas=config.betas, weight_decay=config.weight_decay, eps=1e-8
            )
        else:
            self.optimizer = torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay)
        self.scaler = (
            torch.amp.GradScaler("cpu", init_scale=config.loss_scale, growth_interval=config.loss_scale_growth_interval)
            if self.dtype == torch.float16
            else None
        )

    # ----------------------------------------------------------------------------------------------------------
    # weights

    def master_state(self) -> dict[str, torch.Tensor]:
        return {n: p.detach() for n, p in self.master.items()}

    @torch.no_grad()
    def set_compute_weights(self, served: dict[str, torch.Tensor] | None = None) -> None:
        """The compute copy := ``served`` (loss on the served copy) or the RNE cast of the master.

        ``served`` of a quantized engine is its checkpoint's tensors (``Exporter(..., scheme=)``): each quantized
        linear then computes with exactly the served codes (``quant.grid.serve``), its compute weight set to their
        dequantized value; everything else is copied as above."""
        linears = {}
        from roundalign.quant import checkpoint

        if served is not None and checkpoint.is_checkpoint(served):
            linears, served = checkpoint.split(served, self.scheme)
            served |= {f"{name}.weight": q.dequantize(self.dtype) for name, q in linears.items()}
        for name, p in self._compute.items():
            src = served[name] if served is not None else self.master[name].detach().to(self.dtype)
            p.copy_(src)  # already 16-bit: no rounding here
        if linears:
            from roundalign.quant.grid import serve

            for name, q in linears.items():
                serve(self._compute[f"{name}.weight"], q)  # after the copy: its version is the one served

    # ----------------------------------------------------------------------------------------------------------
    # log-probs

    def _logits(self, prompt: list[int], completion: list[int]) -> torch.Tensor:
        """Logits rows predicting each completion token, fp32 / temperature (as the engine's processed log-probs)."""
        return completion_logits(self.model, prompt, completion).float() / self.config.temperature

    @torch.no_grad()
    def logprobs(self, prompt: list[int], completion: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probs of the completion tokens, per-token entropy in nats), fp32, no gradient: the recompute."""
        return completion_logprobs(self._logits(prompt, completion), completion, with_entropy=True)

    def logprobs_with_grad(self, prompt: list[int], completion: list[int]) -> torch.Tensor:
        return completion_logprobs(self._logits(prompt, completion), completion)

    # ----------------------------------------------------------------------------------------------------------
    # gradients and the update

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=False)
        for p in self.master.values():
            if p.grad is None:
                p.grad = torch.zeros_like(p)

    def backward(self, loss: torch.Tensor, step: int) -> None:
        """Backpropagate one micro-batch's loss and add its 16-bit gradients into the fp32 master gradients."""
        if not torch.isfinite(loss):
            raise NonFiniteError(f"step {step}: the loss is {loss.item()} (non-finite) before the backward pass")
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        for name, p in self._compute.items():
            if p.grad is not None:
                self.master[name].grad.add_(p.grad.float())  # 16-bit -> fp32 is exact; the sum is fp32
                p.grad = None

    def step(self, step: int) -> dict[str, float]:
        """Unscale (fp16), check, clip, and apply the optimizer. Returns the actor/* update metrics."""
        params = list(self.master.values())
        out: dict[str, float] = {"actor/lr": self.config.lr}
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        else:
            for name, p in self.master.items():
                if not torch.isfinite(p.grad).all():
                    raise NonFiniteError(
                        f"step {step}: the gradient of {name} has non-finite values "
                        f"({int((~torch.isfinite(p.grad)).sum())} of {p.grad.numel()})"
                    )
        max_norm = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm))  # the norm before clipping, as verl logs it
        out["actor/grad_norm"] = norm
        if self.scaler is not None:
            scale = float(self.scaler.get_scale())
            self.scaler.step(self.optimizer)  # skipped when the unscaled gradients hold inf/nan: that is the design
            self.scaler.update()
            out["actor/loss_scale"] = scale
            out["actor/skipped_step"] = float(not torch.isfinite(torch.tensor(norm)))
            if self.scaler.get_scale() < 2.0**-24:
                raise NonFiniteError(
                    f"step {step}: the fp16 loss scale fell to {self.scaler.get_scale():g}: every "
                    "step overflows even unscaled; the run has diverged"
                )
        else:
            if not torch.isfinite(torch.tensor(norm)):
                raise NonFiniteError(f"step {step}: the total gradient norm is {norm}")
            self.optimizer.step()
        return out

    # ----------------------------------------------------------------------------------------------------------
    # checkpoints

    def state_dict(self) -> dict:
        return {
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict() if self.scaler is not None else None,
        }

    def load_state_dict(self, master: dict[str, torch.Tensor], state: dict) -> None:
        with torch.no_grad():
            for name, p in self.master.items():
                p.copy_(master[name])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler is not None:
            self.scaler.load_state_dict(state["scaler"])
