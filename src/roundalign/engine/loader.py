"""The engine's served copy of the weights: where it comes from, what it must look like, and how it is replaced.

An engine serves its own 16-bit copy of the policy (bf16, or fp16 for an fp16 engine), separate from the trainer's
parameters: in RL the trainer updates its (often fp32 master) weights and pushes them to the engine, which rounds
them to its dtype on the way in. The served
copy here is ``ServedWeights``, a tree of modules whose buffers carry HF's state_dict names
(``model.layers.0.self_attn.q_proj.weight`` ...), so that ``load_weights`` takes an HF state_dict as it is. The
modules hold tensors only; the numerics live in ``model.py`` (kernels backend) and ``native.py`` (inductor backend).

Loading checks everything before it changes anything, and every error names the file or tensor and the fix:
missing or corrupt model directory, unsupported family or attention/RoPE variant, unknown or missing tensors,
wrong shapes, an unknown sync mode, a weight that overflows the served dtype (fp16's largest finite value is
65504; a bf16 or fp32 weight beyond it would be served as inf).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from roundalign.errors import MissingFile, UserError
from roundalign.numerics.dtypes import LOW_PRECISION
from roundalign.support import ENGINE_FAMILIES, check_engine_model, head_dim
from roundalign.sync import MODES as EXPORT_MODES
from roundalign.sync import Exporter

SUPPORTED_FAMILIES = ENGINE_FAMILIES


def check_config(config) -> None:
    """Refuse what the engine does not implement, before any weight is read (``roundalign.support``)."""
    check_engine_model(config)


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    """(fp32 inv_freq, attention scaling) from the config, as an engine computes them at load; the same function
    the patched trainer uses (``roundalign.rotary.engine_inv_freq``) with the family's default RoPE init."""
    import importlib

    from roundalign.rotary import engine_inv_freq

    family = config.model_type
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary = getattr(module, f"{_CLASS_PREFIX[family]}RotaryEmbedding")
    return engine_inv_freq(config, rotary.compute_default_rope_parameters)


_CLASS_PREFIX = {"qwen3": "Qwen3", "qwen2": "Qwen2", "llama": "Llama"}


# --------------------------------------------------------------------------------------------------------------
# the served copy


class _Linear(nn.Module):
    def __init__(self, out_features: int, in_features: int, bias: bool, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=dtype))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype) if bias else None)


class _Weight(nn.Module):
    """A norm's or the embedding's ``weight``."""

    def __init__(self, *shape: int, dtype: torch.dtype):
        super().__init__()
        self.register_buffer("weight", torch.zeros(*shape, dtype=dtype))


class _Attention(nn.Module):
    def __init__(self, config, dtype: torch.dtype, qk_norm: bool, qkv_bias: bool, o_bias: bool):
        super().__init__()
        d, h = head_dim(config), config.hidden_size
        q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
        self.q_proj, self.k_proj = _Linear(q, h, qkv_bias, dtype), _Linear(kv, h, qkv_bias, dtype)
        self.v_proj = _Linear(kv, h, qkv_bias, dtype)
        self.o_proj = _Linear(h, q, o_bias, dtype)
        self.add_module("q_norm", _Weight(d, dtype=dtype) if qk_norm else None)  # a submodule slot either way
        self.add_module("k_norm", _Weight(d, dtype=dtype) if qk_norm else None)


class _MLP(nn.Module):
    def __init__(self, config, dtype: torch.dtype, bias: bool):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj, self.up_proj = _Linear(i, h, bias, dtype), _Linear(i, h, bias, dtype)
        self.down_proj = _Linear(h, i, bias, dtype)


class _Layer(nn.Module):
    def __init__(self, config, dtype: torch.dtype, **attention_kw):
        super().__init__()
        self.input_layernorm = _Weight(config.hidden_size, dtype=dtype)
        self.self_attn = _Attention(config, dtype, **attention_kw)
        self.post_attention_layernorm = _Weight(config.hidden_size, dtype=dtype)
        self.mlp = _MLP(config, dtype, bias=bool(getattr(config, "mlp_bias", False)))


class _Body(nn.Module):
    def __init__(self, config, dtype: torch.dtype, **attention_kw):
        super().__init__()
        self.embed_tokens = _Weight(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(_Layer(config, dtype, **attention_kw) for _ in range(config.num_hidden_layers))
        self.norm = _Weight(config.hidden_size, dtype=dtype)


def check_dtype(dtype) -> torch.dtype:
    """The engine's served dtype: bf16 or fp16, anything else is a ValueError that names the choices."""
    if dtype not in LOW_PRECISION:
        raise UserError(
            f"unknown engine dtype {dtype!r}; choose torch.bfloat16 (the default) or torch.float16 "
            "(an fp16 engine, for an fp16 trainer)"
        )
    return dtype


class ServedWeights(nn.Module):
    """``dtype`` (bf16 or fp16) tensors under HF's names: ``model.embed_tokens``, ``model.layers[i]...``,
    ``model.norm``, ``lm_head``.

    Biases follow each family's HF modules: Qwen2 has q/k/v biases; Qwen3 and Llama have q/k/v/o biases only with
    ``attention_bias``, and Llama MLP biases with ``mlp_bias``. With ``tie_word_embeddings`` the lm_head weight is
    the embedding tensor itself, as in HF.
    """

    def __init__(self, config, dtype: torch.dtype = torch.bfloat16):
        super().__init__()
        check_config(config)
        self.dtype = check_dtype(dtype)
        self._exporters: dict[tuple[str, int], Exporter] = {}  # load(sync="stochastic" / "error-feedback")
        family = config.model_type
        bias = bool(getattr(config, "attention_bias", False))
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.model = _Body(
            config,
            dtype,
            qk_norm=family == "qwen3",
            qkv_bias=bias or family == "qwen2",
            o_bias=bias and family != "qwen2",
        )
        self.lm_head = _Linear(config.vocab_size, config.hidden_size, False, dtype)
        if self.tied:
            self.lm_head.weight = self.model.embed_tokens.weight

    def expected(self) -> dict[str, torch.Tensor]:
        """Every tensor a state_dict must provide, by HF name (the tied lm_head is optional)."""
        return dict(self.state_dict(keep_vars=True))

    @torch.no_grad()
    def load(self, state_dict: dict, sync: str = "rne", seed: int = 0) -> None:
        """Copy HF-named tensors (fp32, bf16 or fp16) into the served copy, rounding to the served dtype by the sync
        mode ``sync``, in place. A finite weight that would become inf in the served dtype (fp16) is an error.

        ``sync`` is one of ``roundalign.sync.MODES``. ``"rne"`` is the plain cast. ``"stochastic"`` and
        ``"error-feedback"`` need fp32 masters and round with one ``roundalign.sync.Exporter`` per (sync, seed),
        kept across calls (its generators and residuals are this served copy's state): the engine-side Fair Cast,
        for frameworks that hand the engine fp32 tensors and let it cast them."""
        if sync not in EXPORT_MODES:
            raise UserError(f"unknown sync mode {sync!r}; supported: {', '.join(EXPORT_MODES)}")
        if not isinstance(state_dict, dict):
            raise TypeError(f"load_weights needs a dict of HF-named tensors (a state_dict), got {type(state_dict)}")
        expected = self.expected()
        unknown = sorted(set(state_dict) - set(expected))
        if unknown:
            raise UserError(
                f"unknown tensor name(s) {unknown[:5]}{' ...' if len(unknown) > 5 else ''}: the served copy has "
                f"{len(expected)} tensors named as in HF's {type(self).__name__} state_dict (e.g. "
                "'model.layers.0.self_attn.q_proj.weight'); strip wrapper prefixes such as 'module.' or '_orig_mod.'"
            )
        optional = {"lm_head.weight"} if self.tied else set()
        missing = sorted(set(expected) - set(state_dict) - optional)
        if missing:
            raise UserError(
                f"missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}; "
                "load_weights replaces the whole served copy, pass every tensor"
            )
        for name, src in state_dict.items():
            dst = expected[name]
            if not isinstance(src, torch.Tensor) or not src.is_floating_point():
                raise TypeError(f"tensor {name!r} must be a floating-point torch.Tensor, got {_describe(src)}")
            if tuple(src.shape) != tuple(dst.shape):
                raise UserError(f"tensor {name!r} has shape {tuple(src.shape)}, the model needs {tuple(dst.shape)}")
        if self.tied and "lm_head.weight" in state_dict and "model.embed_tokens.weight" in state_dict:
            a, b = state_dict["lm_head.weight"], state_dict["model.embed_tokens.weight"]
            if a.data_ptr() != b.data_ptr() and not torch.equal(a, b):
                raise UserError(
                    "tie_word_embeddings is set but 'lm_head.weight' differs from "
                    "'model.embed_tokens.weight'; pass one of them, or untie the config"
                )
        served = {}
        if sync != "rne":
            exporter = self._exporters.get((sync, seed))
            if exporter is None:
                exporter = self._exporters[(sync, seed)] = Exporter(sync, seed=seed, dtype=self.dtype)
            exported = exporter.export({n: t.detach().cpu() for n, t in state_dict.items()})
        for name, src in state_dict.items():
            # RNE: torch's fp32 -> bf16/fp16 cast rounds to nearest, ties to even.
            served[name] = exported[name] if sync != "rne" else src.detach().to(device="cpu", dtype=self.dtype)
            _check_overflow(name, src, served[name])
        for name, value in served.items():
            expected[name].copy_(value)  # in place: compiled graphs read these tensors


def _check_overflow(name: str, src: torch.Tensor, served: torch.Tensor) -> None:
    """A finite source value that rounds to inf: fp16's range ends at 65504, bf16's and fp32's near 3.4e38.

    Values below fp16's normal range only lose precision (subnormals, or 0 below 2^-25) and are accepted: that is
    the sync an fp16 engine applies too. An inf would poison every activation it touches, so it is refused.
    """
    bad = torch.isinf(served) & torch.isfinite(src.detach().cpu())
    if bad.any():
        worst = src.detach().cpu()[bad].abs().max().item()
        raise UserError(
            f"tensor {name!r} has {int(bad.sum())} value(s) (largest magnitude {worst:.6g}) beyond "
            f"{str(served.dtype).replace('torch.', '')}'s largest finite value "
            f"{torch.finfo(served.dtype).max:.6g}: they would be served as inf. Serve this model in bf16 "
            "(dtype=torch.bfloat16), or rescale the weights into range first"
        )


def _describe(x) -> str:
    return f"{x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__


# --------------------------------------------------------------------------------------------------------------
# from an HF model or a directory


def load(model_or_path, tokenizer=None, dtype: torch.dtype = torch.bfloat16):
    """(config, ServedWeights in ``dtype``, tokenizer or None, eos token ids) from an HF ``*ForCausalLM`` or a model
    directory."""
    if isinstance(model_or_path, nn.Module):
        config = getattr(model_or_path, "config", None)
        if config is None or not hasattr(model_or_path, "lm_head"):
            raise TypeError(
                f"Engine needs an HF *ForCausalLM (a config and an lm_head), got "
                f"{type(model_or_path).__name__}; pass the causal-LM model, not its base model"
            )
        check_config(config)
        weights = ServedWeights(config, dtype)
        # A copy: later changes to the HF model (a training step) do not reach the engine until load_weights.
        weights.load(dict(model_or_path.state_dict()))
        gen = getattr(model_or_path, "generation_config", None)
        return config, weights, tokenizer, _eos_ids(config, gen)
    if not isinstance(model_or_path, (str, Path)):
        raise TypeError(
            f"Engine needs an HF *ForCausalLM or a model directory path, got {type(model_or_path).__name__}"
        )
    path = Path(model_or_path)
    config = read_config(path)
    check_config(config)
    weights = ServedWeights(config, dtype)
    weights.load(_read_safetensors(path))
    if tokenizer is None:
        tokenizer = read_tokenizer(path)
    return config, weights, tokenizer, _eos_ids(config, _read_generation_config(path))


def read_config(path: Path):
    """The HF config of model directory ``path``, with errors that say what is missing or broken.

    Shared with the probe's trainer side (``roundalign.trainer``), which loads the same directories.
    """
    import transformers

    if not path.is_dir():
        raise MissingFile(
            f"model directory {str(path)!r} does not exist; pass a directory written by "
            "save_pretrained (config.json + *.safetensors)"
        )
    if not (path / "config.json").is_file():
        raise UserError(f"{str(path)!r} has no config.json; pass a directory written by save_pretrained")
    try:
        json.loads((path / "config.json").read_text())
        return transformers.AutoConfig.from_pretrained(path)
    except (ValueError, KeyError, OSError) as e:
        raise UserError(
            f"cannot read {str(path / 'config.json')!r} ({e}); re-save the model with save_pretrained"
        ) from e


def _read_safetensors(path: Path) -> dict:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise UserError(
            f"no *.safetensors weights in {str(path)!r}; save the model with "
            "save_pretrained(..., safe_serialization=True), the default"
        )
    state = {}
    for f in files:
        try:
            state.update(load_file(f))
        except (SafetensorError, OSError, ValueError, RuntimeError) as e:
            raise UserError(f"corrupt or unreadable weights file {str(f)!r} ({e}); re-save the model") from e
    return state


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def read_tokenizer(path: Path):
    """The directory's tokenizer, or None when it has no tokenizer files (token-id prompts still work)."""
    import transformers

    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    try:
        return transformers.AutoTokenizer.from_pretrained(path)
    except (ValueError, OSError, KeyError, TypeError) as e:
        raise UserError(
            f"cannot load the tokenizer in {str(path)!r} ({e}); fix or remove its tokenizer files, "
            "or pass tokenizer= explicitly"
        ) from e


def _read_generation_config(path: Path):
    import transformers

    if not (path / "generation_config.json").is_file():
        return None
    try:
        return transformers.GenerationConfig.from_pretrained(path)
    except (ValueError, OSError) as e:
        raise UserError(f"cannot read {str(path / 'generation_config.json')!r} ({e})") from e


def _eos_ids(config, generation_config) -> frozenset[int]:
    """End-of-sequence ids from the config and the generation config, as vLLM collects them."""
    ids: set[int] = set()
    for source in (config, generation_config):
        eos = getattr(source, "eos_token_id", None) if source is not None else None
        if eos is None:
            continue
        ids.update([eos] if isinstance(eos, int) else eos)
    return frozenset(int(i) for i in ids)
