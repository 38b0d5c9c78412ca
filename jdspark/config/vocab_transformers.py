"""transformers' `DeepseekV4Config.to_dict()` spellings, read as part of the HF vocabulary:
`layer_types` + `compress_rates` for `compress_ratios`, `mlp_layer_types` for `num_hash_layers`,
`partial_rotary_factor` for `qk_rope_head_dim` and the nested `rope_parameters` for the RoPE keys.
Where a checkpoint also has the HF name, the HF name wins."""

from __future__ import annotations

from typing import Any

from jdspark.config.base import CSA_RATIO, ConfigError

LAYER_TYPE_KIND = {
    "sliding_attention": "window",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}
KEYS = ("layer_types", "compress_rates", "mlp_layer_types", "partial_rotary_factor")


def pop(data: dict) -> dict[str, Any]:
    """Remove this vocabulary's layer keys from `data` (before the HF names are read)."""
    return {key: data.pop(key, None) for key in KEYS}


def apply(spelled: dict[str, Any], kw: dict[str, Any], source: str) -> None:
    """Fill the HF fields the checkpoint gave only in transformers' spelling (`spelled`, from `pop`)."""
    partial = spelled["partial_rotary_factor"]
    if "qk_rope_head_dim" not in kw and partial is not None and "head_dim" in kw:
        kw["qk_rope_head_dim"] = int(kw["head_dim"] * partial)
    if spelled["layer_types"] is not None and "compress_ratios" not in kw:
        kw["compress_ratios"] = ratios_from_layer_types(spelled["layer_types"], spelled["compress_rates"], source)
    if spelled["mlp_layer_types"] is not None and "num_hash_layers" not in kw:
        kw["num_hash_layers"] = hash_layers_from_types(spelled["mlp_layer_types"], source)


def rope_scaling(params: dict, kw: dict[str, Any]) -> dict:
    """The YaRN settings inside `rope_parameters` (flat, or nested as {"main", "compress"}); the
    nested form's RoPE bases go to `kw`."""
    if not isinstance(params.get("compress"), dict):
        return params
    main, scaling = params.get("main") or {}, params["compress"]
    if "rope_theta" in main:
        kw["rope_theta"] = main["rope_theta"]
    if "rope_theta" in scaling:
        kw["compress_rope_theta"] = scaling["rope_theta"]
    return scaling


def ratios_from_layer_types(layer_types, compress_rates, source) -> list[int]:
    rates = {"csa": CSA_RATIO, "hca": 128}
    for name, value in (compress_rates or {}).items():
        if name not in LAYER_TYPE_KIND or name == "sliding_attention":
            raise ConfigError(f"{source}: compress_rates has unknown layer type {name!r}")
        rates[LAYER_TYPE_KIND[name]] = int(value)
    if rates["csa"] != CSA_RATIO:
        raise ConfigError(f"{source}: compress_rates['compressed_sparse_attention']={rates['csa']}; CSA is ratio 4")
    out = []
    for i, t in enumerate(layer_types):
        if t not in LAYER_TYPE_KIND:
            raise ConfigError(f"{source}: layer_types[{i}]={t!r}; expected one of {sorted(LAYER_TYPE_KIND)}")
        kind = LAYER_TYPE_KIND[t]
        out.append(0 if kind == "window" else rates[kind])
    return out


def hash_layers_from_types(mlp_layer_types, source) -> int:
    n = 0
    while n < len(mlp_layer_types) and mlp_layer_types[n] == "hash_moe":
        n += 1
    if any(t != "moe" for t in mlp_layer_types[n:]):
        raise ConfigError(f"{source}: mlp_layer_types must be 'hash_moe' x n followed by 'moe'; got {mlp_layer_types}")
    return n
