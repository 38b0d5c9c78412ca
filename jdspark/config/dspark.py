"""`DSparkConfig`: the DSpark drafter's settings, parsed from a checkpoint's `dspark_*` keys.

`DSV4Config` parses them once, at construction, into its `dspark` field; the keys themselves stay in
`DSV4Config.extra` verbatim, so a config writes back exactly what it read.
"""

from __future__ import annotations

import dataclasses

from jdspark.config.base import ConfigError

PREFIX = "dspark_"  # every key of the drafter's settings starts so; the readers keep them verbatim
MARKER = "dspark_block_size"  # present iff the checkpoint has a DSpark drafter
REQUIRED = ("dspark_noise_token_id", "dspark_target_layer_ids", "dspark_markov_rank")


@dataclasses.dataclass(frozen=True)
class DSparkConfig:
    """DSpark drafter settings, named as the DeepSeek-V4-Flash-0731 config names them.

    `target_layer_ids` are 0-based main layers whose outputs feed the drafter (reading (A) of spec
    dspark.md §3.9: the output of layer l, averaged over the HC streams). The drafter's stages are
    the model's extra layers after the main ones, so `num_stages` is `num_nextn_predict_layers`.
    """

    block_size: int  # gamma: drafted tokens per block
    noise_token_id: int
    target_layer_ids: tuple[int, ...]
    markov_rank: int
    num_stages: int
    # Sequential temperature scaling of the confidence logits (spec dspark.md §10): c_k =
    # sigmoid(z_k / T_k). Key `dspark_confidence_temperatures`; absent means all 1 (raw head).
    confidence_temperatures: tuple[float, ...] | None = None

    @classmethod
    def from_keys(cls, keys: dict, config) -> "DSparkConfig | None":
        """The settings in `keys` (a config's `dspark_*` entries) for the model `config` describes
        (a `DSV4Config`: its vocabulary, main layers and extra layers), or None without a drafter."""
        if MARKER not in keys:
            return None
        try:
            temps = keys.get("dspark_confidence_temperatures")
            d = cls(block_size=int(keys[MARKER]), noise_token_id=int(keys["dspark_noise_token_id"]),
                    target_layer_ids=tuple(int(i) for i in keys["dspark_target_layer_ids"]),
                    markov_rank=int(keys["dspark_markov_rank"]), num_stages=config.num_nextn_predict_layers,
                    confidence_temperatures=None if temps is None else tuple(float(t) for t in temps))
        except KeyError as e:
            raise ConfigError(f"config has {MARKER} but lacks {e.args[0]}; a DSpark config needs "
                              f"{', '.join(REQUIRED[:-1])} and {REQUIRED[-1]}") from None
        d._check(config.vocab_size, config.num_hidden_layers)
        return d

    def _check(self, vocab_size: int, num_hidden_layers: int) -> None:
        if self.block_size < 1 or self.markov_rank < 1 or self.num_stages < 1:
            raise ConfigError(f"dspark_block_size={self.block_size}, dspark_markov_rank={self.markov_rank} and "
                              f"num_nextn_predict_layers={self.num_stages} (drafter stages) must all be >= 1")
        if not 0 <= self.noise_token_id < vocab_size:
            raise ConfigError(f"dspark_noise_token_id={self.noise_token_id} is outside the vocabulary [0, {vocab_size})")
        temps = self.confidence_temperatures
        if temps is not None and (len(temps) != self.block_size or not all(t > 0 for t in temps)):
            raise ConfigError(f"dspark_confidence_temperatures={list(temps)}: need {self.block_size} positive numbers "
                              "(one per draft position)")
        bad = [i for i in self.target_layer_ids if not 0 <= i < num_hidden_layers]
        if bad or not self.target_layer_ids:
            raise ConfigError(f"dspark_target_layer_ids={list(self.target_layer_ids)}: need one or more layer ids in "
                              f"[0, {num_hidden_layers})")
