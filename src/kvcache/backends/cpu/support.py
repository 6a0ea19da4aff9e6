"""Which models a step that calls no module can stand in for (the float32, half and blocks steps).

Such a step computes the forward of the plain decoder layout (norms before each sublayer,
queries and keys normalised per head or not at all, SwiGLU, no gemma scalings or soft-caps)
from the model's weights. A model whose modules would do more than their classes' forwards
(hooks, subclasses, a replaced `forward`), whose parameters are shared other than the tied
embeddings, or whose norms differ in eps, is one it cannot stand in for.
"""

from __future__ import annotations

import torch
from torch import nn

from kvcache.backends.base import BackendError
from kvcache.backends.cpu import numba_products
from kvcache.model import LlamaForCausalLM
from kvcache.model.llama import MLP, Attention, DecoderLayer, DecoderModel, RMSNorm
from kvcache.model.rope import RotaryEmbedding

# module classes whose forwards the steps compute
_STANDARD_MODULES = frozenset(
    (
        LlamaForCausalLM,
        DecoderModel,
        DecoderLayer,
        Attention,
        MLP,
        RMSNorm,
        RotaryEmbedding,
        nn.ModuleList,
        nn.Linear,
        nn.Embedding,
    )
)


def _hooked(module: nn.Module) -> bool:
    """Whether calling `module` does more than its class's forward: a forward hook or pre-hook,
    or a `forward` set on the instance."""
    return bool(module._forward_hooks or module._forward_pre_hooks or "forward" in module.__dict__)


def unsupported_structure(model, step: str, more_modules: tuple[type, ...] = ()) -> str | None:
    """Why a step named `step` ("the float32 step") cannot compute `model`'s decode forward
    whatever its weights' dtype, or None when it can; `more_modules`: module classes besides
    the standard ones whose forwards it computes too."""
    config = model.config
    plain = (
        config.norm_placement == "pre"
        and config.qk_norm in (None, "head")
        and config.hidden_act == "silu"
        and not config.norm_weight_offset
        and config.local_rope_theta is None
        and all(
            value is None
            for value in (
                config.embedding_scale,
                config.attention_scale,
                config.attn_logit_softcap,
                config.final_logit_softcap,
            )
        )
    )
    if not plain:
        return (
            f"{config.model_type}'s norm placement, norms across heads, GELU, scalings or "
            f"soft-capping are not in {step}"
        )
    registry = torch.nn.modules.module
    if registry._global_forward_hooks or registry._global_forward_pre_hooks:
        return f"global module forward hooks are registered ({step} calls no module)"
    for name, module in model.named_modules():
        where = f"module {name or 'model'}"
        if type(module) not in _STANDARD_MODULES and type(module) not in more_modules:
            return f"{where} is a {type(module).__name__}, whose forward {step} lacks"
        if _hooked(module):
            return f"{where} has forward hooks or its own forward ({step} calls no module)"
    tied = getattr(model.lm_head, "weight", None) is getattr(model.model.embed_tokens, "weight", False)
    if len(list(model.parameters())) != len(list(model.named_parameters(remove_duplicate=False))) - tied:
        return "a parameter is shared between modules (other than tied embeddings)"
    if len({module.eps for module in model.modules() if isinstance(module, RMSNorm)}) != 1:
        return "its RMSNorms have different eps"
    return None


def unsupported_parameters(model, dtypes: tuple[torch.dtype, ...], step: str) -> str | None:
    """Why `model`'s parameters are not all of one dtype among `dtypes` on the CPU, or None."""
    first = next(model.parameters()).dtype
    for name, parameter in model.named_parameters():
        if parameter.dtype not in dtypes or parameter.dtype != first or parameter.device.type != "cpu":
            wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            same = " (every parameter the same one)" if len(dtypes) > 1 else ""
            return (f"parameter {name} is {parameter.dtype} on {parameter.device}; {step} needs "
                    f"{wanted} on CPU{same}")
    return None


def fused_products(layer) -> list[tuple[str, tuple[nn.Module, ...]]]:
    """A decoder layer's products as the CPU steps fuse them, in order: (name, its projections)
    for qkv (q, k, v), o, gate_up (gate, up) and down."""
    attention, mlp = layer.self_attn, layer.mlp
    return [("qkv", (attention.q_proj, attention.k_proj, attention.v_proj)), ("o", (attention.o_proj,)),
            ("gate_up", (mlp.gate_proj, mlp.up_proj)), ("down", (mlp.down_proj,))]


def unsupported_kernels() -> str | None:
    """Why the CPU backends' steps cannot run here (numba without a threading layer whose
    kernels they compile), or None."""
    if numba_products.available():
        return None
    return "its steps run on numba's kernels: install numba (with OpenMP or TBB threads)"


def require(reason: str | None, backend: str) -> None:
    """Raise `BackendError` naming `backend` ("the float32 backend") and `reason`, unless the
    reason is None."""
    if reason is not None:
        raise BackendError(f"{backend} cannot run this model: {reason}; use the torch backend")
