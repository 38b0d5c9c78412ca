"""Tiny random transformers DeepseekV4 models written in the official checkpoint layout.

transformers is an independent implementation of the official model (spec hf_reference.md); it has
no MTP module, so the MTP reference is assembled here from its decoder layer, RMSNorm and HC head.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from jdspark.checkpoint.formats import config_with
from jdspark.checkpoint.names import locate, path_to_official
from jdspark.checkpoint.quantize import quantize_tensors
from jdspark.checkpoint.safetensors_io import save_file
from jdspark.config import DSV4Config
from jdspark.model.quantized import Storage, is_expert
from tests.model.dequant_ref import dequantize_tensors

_KIND_TO_HF = {"window": "sliding_attention", "csa": "compressed_sparse_attention",
               "hca": "heavily_compressed_attention"}


def hf_config(cfg: DSV4Config, extra_window_layers: int = 0) -> DeepseekV4Config:
    """transformers config for `cfg` (plus trailing window-only layers, used to build the MTP block)."""
    n = cfg.num_hidden_layers + extra_window_layers
    hca = {r for r in cfg.compress_ratios if r not in (0, 4)}
    assert len(hca) <= 1, "transformers has one HCA ratio per model"
    rope = {"rope_type": "yarn", "factor": cfg.rope_factor, "beta_fast": cfg.beta_fast, "beta_slow": cfg.beta_slow,
            "original_max_position_embeddings": cfg.original_seq_len} if cfg.original_seq_len else None
    c = DeepseekV4Config(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, moe_intermediate_size=cfg.moe_intermediate_size,
        num_hidden_layers=n, num_attention_heads=cfg.num_attention_heads, num_key_value_heads=1,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank, num_experts_per_tok=cfg.num_experts_per_tok,
        n_routed_experts=cfg.n_routed_experts, n_shared_experts=1, scoring_func=cfg.scoring_func,
        routed_scaling_factor=cfg.routed_scaling_factor, max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta, compress_rope_theta=cfg.compress_rope_theta,
        layer_types=[_KIND_TO_HF[cfg.layer_kind(i)] for i in range(cfg.num_hidden_layers)]
        + ["sliding_attention"] * extra_window_layers,
        compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": hca.pop() if hca else 128},
        mlp_layer_types=["hash_moe"] * cfg.num_hash_layers + ["moe"] * (n - cfg.num_hash_layers),
        hc_mult=cfg.hc_mult, hc_sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps,
        swiglu_limit=cfg.swiglu_limit, sliding_window=cfg.sliding_window, o_groups=cfg.o_groups,
        o_lora_rank=cfg.o_lora_rank, index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, num_nextn_predict_layers=0,
        partial_rotary_factor=cfg.qk_rope_head_dim / cfg.head_dim, rope_parameters=rope,
        rms_norm_eps=cfg.rms_norm_eps, bos_token_id=0, eos_token_id=1,
    )
    c._attn_implementation = "eager"
    return c


def randomize(module: torch.nn.Module, gen: torch.Generator, n_experts: int) -> None:
    """Every parameter and routing buffer non-trivially random (transformers' init leaves biases,
    sinks, ape, hc base/scale and the gate bias constant, which would hide bugs)."""
    def normal(shape, std):
        return torch.randn(shape, generator=gen) * std

    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.split(".")[-1]
            if leaf == "sinks":
                p.copy_(normal(p.shape, 1.0))
            elif leaf == "position_bias":
                p.copy_(normal(p.shape, 0.5))
            elif leaf in ("base", "hc_base"):
                p.copy_(normal(p.shape, 0.5))
            elif leaf in ("scale", "hc_scale"):
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif p.ndim == 1:  # RMSNorm weights
                p.copy_(1.0 + normal(p.shape, 0.2))
            elif "embed" in name:
                p.copy_(normal(p.shape, 1.0))
            else:  # [out, in] linears, hc fn, stacked experts [E, out, in]
                p.copy_(normal(p.shape, p.shape[-1] ** -0.5))
        for name, b in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(normal(b.shape, 0.1))
            elif name.endswith("tid2eid"):
                rows = [torch.randperm(n_experts, generator=gen)[: b.shape[1]] for _ in range(b.shape[0])]
                b.copy_(torch.stack(rows))


class Oracle:
    """A random transformers model (+ an MTP block assembled from its parts) for one config."""

    def __init__(self, cfg: DSV4Config, seed: int):
        torch.manual_seed(seed)
        gen = torch.Generator().manual_seed(seed)
        self.cfg = cfg
        self.stored, self.dtype_names = None, {}
        self.model = DeepseekV4ForCausalLM(hf_config(cfg)).eval()
        randomize(self.model, gen, cfg.n_routed_experts)
        self.mtp = None
        if cfg.num_nextn_predict_layers:
            ext = hf_config(cfg, extra_window_layers=1)
            d = cfg.hidden_size
            self.mtp = torch.nn.ModuleDict(dict(
                layer=hf.DeepseekV4DecoderLayer(ext, cfg.num_hidden_layers),
                e_proj=torch.nn.Linear(d, d, bias=False), h_proj=torch.nn.Linear(d, d, bias=False),
                enorm=hf.DeepseekV4RMSNorm(d, cfg.rms_norm_eps), hnorm=hf.DeepseekV4RMSNorm(d, cfg.rms_norm_eps),
                norm=hf.DeepseekV4RMSNorm(d, cfg.rms_norm_eps), hc_head=hf.DeepseekV4HyperHead(ext),
            )).eval()
            randomize(self.mtp, gen, cfg.n_routed_experts)
            self.rotary = hf.DeepseekV4RotaryEmbedding(ext)

    def _pieces(self):
        """(tensor, Piece) for every weight of the transformers model and of the assembled MTP block;
        the MTP block's decoder layer is built as layer `num_hidden_layers` and renamed to `mtp.0`."""
        for key, t in self.model.state_dict().items():
            if "rotary_emb" not in key:
                yield from ((t, piece) for piece in locate(key, tuple(t.shape)))
        if self.mtp is None:
            return
        n = self.cfg.num_hidden_layers
        for key, t in self.mtp.state_dict().items():
            name = f"layers.{n}.{key.removeprefix('layer.')}" if key.startswith("layer.") else key
            for piece in locate(name, tuple(t.shape)):
                path = piece.path[2:] if key.startswith("layer.") else piece.path
                yield t, piece._replace(path=("mtp", 0, *path))

    def official_tensors(self) -> dict[str, np.ndarray]:
        out = {}
        for t, piece in self._pieces():
            value = t.detach().numpy()[piece.index]
            if piece.expert is None and is_expert(piece.path):
                out.update({path_to_official(piece.path, e): value[e] for e in range(value.shape[0])})
            else:
                out[path_to_official(piece.path, piece.expert)] = value
        return out

    @torch.no_grad()
    def load_official(self, tensors: dict[str, np.ndarray]) -> None:
        """Set the weights from official-named tensors (the inverse of `official_tensors`)."""
        for t, piece in self._pieces():
            if piece.expert is None and is_expert(piece.path):
                value = np.stack([tensors[path_to_official(piece.path, e)] for e in range(t.shape[0])])
            else:
                value = tensors[path_to_official(piece.path, piece.expert)]
            t[piece.index].copy_(torch.from_numpy(np.asarray(value)))

    def quantize(self, storage: Storage) -> None:
        """Round the weights to the values a checkpoint of format `storage` stores (quantized the way
        the official files are); `write` then writes that format."""
        self.stored, self.dtype_names = quantize_tensors(self.official_tensors(), storage)
        self.load_official(dequantize_tensors(self.stored))
        self.cfg = config_with(self.cfg, storage)

    def write(self, path: Path, vocabulary: str = "hf", shards: int = 2) -> Path:
        """Official layout: sharded safetensors + index, config in the HF or the official vocabulary."""
        path.mkdir(parents=True, exist_ok=True)
        tensors = self.stored if self.stored is not None else self.official_tensors()
        names = sorted(tensors)
        weight_map = {}
        for i in range(shards):
            shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::shards]}
            save_file(part, path / shard, self.dtype_names)
            weight_map.update({n: shard for n in part})
        (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
        if vocabulary == "hf":
            (path / "config.json").write_text(json.dumps(self.cfg.to_dict()))
        else:
            (path / "inference").mkdir(exist_ok=True)
            (path / "inference" / "config.json").write_text(json.dumps(self.cfg.to_official_dict()))
        return path

    @torch.no_grad()
    def forward(self, ids: np.ndarray) -> dict[str, np.ndarray]:
        """Logits, final streams, MTP logits and the captured indexer / router scores."""
        captured: dict[str, list] = {"index": [], "router": [], "streams": []}
        hooks = [self.model.model.hc_head.register_forward_hook(
            lambda m, args, out: captured["streams"].append(args[0]))]
        for m in self.model.modules():
            if isinstance(m, hf.DeepseekV4IndexerScorer):
                hooks.append(m.register_forward_hook(lambda m, a, out: captured["index"].append(out)))
            if isinstance(m, hf.DeepseekV4TopKRouter):
                hooks.append(m.register_forward_hook(
                    lambda m, a, out: captured["router"].append(
                        (m.score_fn(out[0]) + m.e_score_correction_bias, m.top_k))))
        try:
            tokens = torch.as_tensor(ids[None], dtype=torch.long)
            logits = self.model(tokens, use_cache=False).logits[0].numpy()
        finally:
            for h in hooks:
                h.remove()
        result = {"logits": logits, "streams": captured["streams"][0][0].numpy(),
                  "index_scores": [s[0].numpy() for s in captured["index"]],
                  "router_scores": [(s.numpy(), k) for s, k in captured["router"]]}
        if self.mtp is not None:
            result["mtp_logits"] = self._mtp(captured["streams"][0][:, :-1], tokens[:, 1:])[0].numpy()
        return result

    def _mtp(self, streams: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        m = self.mtp
        e = m["enorm"](self.model.model.embed_tokens(next_ids))
        x = m["e_proj"](e).unsqueeze(2) + m["h_proj"](m["hnorm"](streams))
        s = next_ids.shape[1]
        pos = torch.arange(s)[None]
        emb = {t: self.rotary(x, position_ids=pos, layer_type=t) for t in ("main", "compress")}
        diff = pos[0][:, None] - pos[0][None, :]
        allowed = (diff >= 0) & (diff < self.cfg.sliding_window)
        mask = torch.where(allowed, 0.0, float("-inf"))[None, None]
        y = m["layer"](x, position_embeddings=emb, position_ids=pos, attention_mask=mask, input_ids=next_ids)
        return self.model.lm_head(m["norm"](m["hc_head"](y)))
