"""One name table: HF (transformers) names -> official checkpoint names -> parameter paths.

Official names (`layers.3.attn.wq_a.weight`, `.scale` for a quantized weight's scales, no `model.`
prefix) are the hub of the table: the module tree mirrors them, except that mHC parameters live in
small submodules (`hc_attn_fn` -> `hc_attn.fn`) and routed experts are stacked
(`ffn.experts.5.w1.weight` -> `ffn.experts.w1.weight[5]`). `locate` sends a tensor of either
vocabulary to its parameter path; nothing else reads checkpoint names.
"""

from __future__ import annotations

import re
from typing import NamedTuple

_HC = re.compile(r"(^|\.)hc_(attn|ffn|head)_(fn|base|scale)$")
_EXPERT = re.compile(r"^(.*\.ffn\.experts)\.(\d+)\.(w[123])\.(weight|scale)$")
# transformers stacks the routed experts: gate_up_proj [E, 2F, D] = (w1 | w3) on rows, down_proj = w2.
_HF_STACKED = re.compile(r"^(.*\.ffn\.experts)\.(gate_up_proj|down_proj)(_scale_inv)?$")
# Copies of the shared embedding / head that some MTP checkpoints carry; the official converter skips them.
_DUPLICATE = re.compile(r"^mtp\.\d+\.(emb\..*|head\.weight)$")


def is_duplicate(name: str) -> bool:
    return bool(_DUPLICATE.match(name))


def official_to_path(name: str) -> tuple[tuple, int | None]:
    """Parameter path of an official tensor name and, for a routed expert, its index on the stacked axis."""
    expert = None
    m = _EXPERT.match(name)
    if m:
        name, expert = f"{m.group(1)}.{m.group(3)}.{m.group(4)}", int(m.group(2))
    else:
        name = _HC.sub(lambda g: f"{g.group(1)}hc_{g.group(2)}.{g.group(3)}", name)
    path = tuple(int(p) if p.isdigit() else p for p in name.split("."))
    return path, expert


def path_to_official(path: tuple, expert: int | None = None) -> str:
    """Inverse of `official_to_path`."""
    parts = [str(p) for p in path]
    if expert is not None:
        return ".".join(parts[:-2] + [str(expert)] + parts[-2:])
    if len(parts) >= 2 and parts[-2] in ("hc_attn", "hc_ffn", "hc_head"):
        parts = parts[:-2] + [f"{parts[-2]}_{parts[-1]}"]
    return ".".join(parts)


# HF (transformers state_dict) -> official, applied in order to the name without its `model.` prefix.
_HF_TO_OFFICIAL = [
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.compressor\.indexer\.scorer\.weights_proj\.", ".attn.indexer.weights_proj."),
    (r"\.self_attn\.compressor\.indexer\.q_b_proj\.", ".attn.indexer.wq_b."),
    (r"\.self_attn\.compressor\.indexer\.", ".attn.indexer.compressor."),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."),
    (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.weight_scale_inv$", ".scale"),  # transformers' name for a block-quantized weight's scales
]


def hf_to_official(name: str) -> str:
    """Official name of a transformers DeepseekV4 state-dict key (stacked experts excepted)."""
    name = name.removeprefix("model.")
    for pattern, repl in _HF_TO_OFFICIAL:
        name = re.sub(pattern, repl, name)
    return name


class Piece(NamedTuple):
    """Where (part of) a checkpoint tensor goes: parameter `path`, routed-expert index (None: the
    whole parameter, or all experts of a stacked one) and the `index` into the stored tensor."""

    path: tuple
    expert: int | None
    index: tuple = ()


def locate(name: str, shape: tuple[int, ...]) -> list[Piece]:
    """The parameter piece(s) a checkpoint tensor of either vocabulary fills; [] for a duplicate
    the official converter skips. transformers' stacked `gate_up_proj` fills w1 and w3 halves."""
    name = hf_to_official(name)
    if is_duplicate(name):
        return []
    m = _HF_STACKED.match(name)
    if m is None:
        return [Piece(*official_to_path(name))]
    prefix = tuple(int(p) if p.isdigit() else p for p in m.group(1).split("."))
    leaf = "scale" if m.group(3) else "weight"
    if m.group(2) == "down_proj":
        return [Piece((*prefix, "w2", leaf), None)]
    half = shape[1] // 2 if len(shape) > 1 else 0
    return [Piece((*prefix, "w1", leaf), None, (slice(None), slice(0, half))),
            Piece((*prefix, "w3", leaf), None, (slice(None), slice(half, None)))]
