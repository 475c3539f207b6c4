"""The served quantized copy as a compressed-tensors checkpoint, which ``vllm.LLM`` loads as it is.

``write`` turns a model's bf16 weights into the checkpoint an engine serves in a scheme: every linear layer but
the lm_head quantized (``roundalign.quant.grid``), the rest (embeddings, norms, lm_head) in bf16, and
``config.json`` with the scheme's ``quantization_config``. The tensors, per quantized linear ``P``, in the layout
compressed-tensors defines and vLLM's ``CompressedTensorsConfig`` reads:

- ``int-quantized`` (W8A8 int8): ``P.weight`` int8 ``(out, in)``, ``P.weight_scale`` ``(out, 1)``;
- ``float-quantized`` (FP8): ``P.weight`` float8_e4m3fn ``(out, in)``, ``P.weight_scale`` ``(out, 1)``;
- ``pack-quantized`` (W4A16): ``P.weight_packed`` int32 ``(out, in / 8)`` (codes + 8, eight per int32 along the
  input, lowest bits first), ``P.weight_scale`` ``(out, in / group)``, ``P.weight_shape`` int64 ``[out, in]``, and
  with zero points ``P.weight_zero_point`` int32 ``(out / 8, in / group)`` (packed along the output).

Scales are stored in bf16, the model's dtype, as compressed-tensors stores them. ``read`` reads such a checkpoint
back (ours, or one an independent producer wrote) as ``{linear name: Quantized}`` and its scheme.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from roundalign import durable
from roundalign.errors import MissingFile, UserError
from roundalign.quant.grid import Quantized, pack_int4, quantize_weight, unpack_int4
from roundalign.quant.schemes import PROJECTIONS, Scheme, from_compressed_tensors
from roundalign.untrusted import read_json_object

_WEIGHT_FILES = (".safetensors", ".bin", ".pt", ".pth")


def is_quantized_linear(name: str, tensor: torch.Tensor) -> bool:
    """Whether state-dict entry ``name`` is a weight the scheme quantizes."""
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and tensor.dim() == 2 and module.rpartition(".")[2] in PROJECTIONS


def is_checkpoint(state_dict: dict) -> bool:
    """Whether ``state_dict`` already is a quantized checkpoint's tensors (``served_state_dict``'s, an export onto
    the grid's), rather than a model's weights: its quantized linears carry their scales."""
    return any(isinstance(k, str) and k.endswith(".weight_scale") for k in state_dict)


def tensors(name: str, q: Quantized, scheme: Scheme) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of one quantized linear (``name`` without ``.weight``)."""
    if scheme.weights in ("int8", "fp8"):
        return {f"{name}.weight": q.codes, f"{name}.weight_scale": q.scale}
    out = {
        f"{name}.weight_packed": pack_int4(q.codes, dim=1),
        f"{name}.weight_scale": q.scale,
        f"{name}.weight_shape": torch.tensor(list(q.codes.shape), dtype=torch.int64),
    }
    if q.zero_point is not None:
        out[f"{name}.weight_zero_point"] = pack_int4(q.zero_point, dim=0)
    return out


def quantize_state_dict(state_dict: dict[str, torch.Tensor], scheme: Scheme) -> tuple[dict, dict]:
    """A model's (HF-named) state dict as the engine serves it: ``({linear name: Quantized}, {name: bf16 tensor})``
    (the linears the scheme quantizes, by module name; everything else in bf16)."""
    quantized, rest = {}, {}
    for name, t in state_dict.items():
        if scheme.quantized and is_quantized_linear(name, t):
            module = name.removesuffix(".weight")
            scheme.check_shape(module, *t.shape)
            quantized[module] = quantize_weight(t, scheme)
        else:
            rest[name] = t.detach().to(torch.bfloat16) if t.is_floating_point() else t.detach()
    return quantized, rest


def served_state_dict(state_dict: dict[str, torch.Tensor], scheme: Scheme, quantized: tuple | None = None) -> dict:
    """What the engine loads for a model's (HF-named) state dict: the checkpoint's tensors (quantized linears, the
    rest in bf16), or for a scheme vLLM quantizes itself at load (``fp8-online``) the bf16 copy it quantizes.
    ``quantized``: ``quantize_state_dict``'s result where the caller has it already. A state dict that already is
    a checkpoint's tensors (an export's: ``roundalign.sync.Exporter(..., scheme=)``) is returned as it is."""
    if not scheme.from_bf16 and is_checkpoint(state_dict):
        return {k: v.contiguous() for k, v in state_dict.items()}
    if scheme.from_bf16:
        return {
            k: v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach() for k, v in state_dict.items()
        }
    linears, rest = quantized if quantized is not None else quantize_state_dict(state_dict, scheme)
    out = dict(rest)
    for module, q in linears.items():
        out.update(tensors(module, q, scheme))
    return {k: v.contiguous() for k, v in out.items()}


def write(model_dir: str | Path, out_dir: str | Path, scheme: Scheme, state_dict: dict | None = None) -> Path:
    """A compressed-tensors checkpoint of ``model_dir``'s model (or of ``state_dict``, HF-named, with
    ``model_dir``'s config and tokenizer) in ``scheme``, at ``out_dir``: written beside it and moved into place
    whole, replacing a served copy written there before. ``state_dict`` may be the checkpoint's tensors already
    (an export onto the grid), which are written as they are."""
    from safetensors.torch import load_file, save_file

    model_dir = Path(model_dir)
    if not (model_dir / "config.json").is_file():
        raise MissingFile(f"{model_dir}: no config.json; give the HF model directory to quantize")
    config = read_json_object(model_dir / "config.json", "a model's config.json")
    if "quantization_config" in config:
        raise UserError(f"{model_dir} is already quantized; quantize the bf16 model it was made from")
    if state_dict is None:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise MissingFile(f"{model_dir}: no *.safetensors weights to quantize")
        state_dict = {k: v for f in files for k, v in load_file(str(f)).items()}
    config = {**config, "quantization_config": scheme.compressed_tensors_config()}  # an online scheme refuses here
    served = served_state_dict(state_dict, scheme)

    out_dir = Path(out_dir)
    if out_dir.exists():
        old = out_dir / "config.json"
        if not (old.is_file() and "quantization_config" in read_json_object(old, "a model's config.json")):
            raise UserError(f"{out_dir} exists and is not a quantized checkpoint; give a new directory to write")
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for f in model_dir.iterdir():
            if (
                f.is_file()
                and f.suffix not in _WEIGHT_FILES
                and f.name != "config.json"
                and not f.name.endswith(".index.json")
            ):
                shutil.copyfile(f, tmp / f.name)
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(served, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        shutil.rmtree(out_dir, ignore_errors=True)  # a served copy written before: replaced whole
        durable.replace_dir(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def read(checkpoint_dir: str | Path) -> tuple[Scheme, dict[str, Quantized]]:
    """A compressed-tensors checkpoint's scheme and its quantized linears, by module name."""
    from safetensors.torch import load_file

    checkpoint_dir = Path(checkpoint_dir)
    config = read_json_object(checkpoint_dir / "config.json", "a model's config.json")
    if "quantization_config" not in config:
        raise UserError(f"{checkpoint_dir} is not a quantized checkpoint (its config.json has no quantization_config)")
    scheme = from_compressed_tensors(config["quantization_config"])
    state = {k: v for f in sorted(checkpoint_dir.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    return scheme, split(state, scheme)[0]


def split(served: dict[str, torch.Tensor], scheme: Scheme) -> tuple[dict[str, Quantized], dict[str, torch.Tensor]]:
    """A checkpoint's tensors (``served_state_dict``'s, or a file's) as ``({linear name: Quantized}, {name: the
    rest})``: ``served_state_dict``'s inverse."""
    linears, used = {}, set()
    for key in served:
        if not key.endswith(".weight_scale"):
            continue
        name = key.removesuffix(".weight_scale")
        scale = served[key].to(torch.bfloat16)
        if scheme.weights in ("int8", "fp8"):
            parts = [f"{name}.weight"]
            codes = served[parts[0]]
        else:
            parts = [f"{name}.weight_packed", f"{name}.weight_shape"]
            codes = unpack_int4(served[parts[0]], dim=1)[:, : int(served[parts[1]][1])]
        zp = served.get(f"{name}.weight_zero_point")
        if zp is not None:
            parts.append(f"{name}.weight_zero_point")
            zp = unpack_int4(zp, dim=0)[: codes.shape[0]]
        codes = codes if scheme.weights == "fp8" else codes.to(torch.int8)
        linears[name] = Quantized(codes, scale.view(codes.shape[0], -1), zp)
        used.update([key, *parts])
    return linears, {k: v for k, v in served.items() if k not in used}


__all__ = [
    "PROJECTIONS", "is_checkpoint", "is_quantized_linear", "quantize_state_dict", "read", "served_state_dict", "split",
    "tensors", "write",
]  # fmt: skip
