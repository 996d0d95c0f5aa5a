"""The drafter's configuration: sizes, target layer ids, block, mask rule, variant. No torch here:
checkpoint formats, pre-flight and the orchestrator read it without loading a model (the model is
:mod:`remote.drafters.dflash`, whose docstring states the conventions these fields follow)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from remote.contract.formats import DFLASH, DOMINO, DSPARK, MAX_BLOCK_SIZE

FULL, SLIDING = "full_attention", "sliding_attention"

# The largest value each size field of a drafter config may take: a checkpoint is input, and every
# one of these sizes an allocation (per-position arrays of the block, layers, embeddings). Far
# beyond any real drafter (DFlash blocks are 8 or 16), far below what would exhaust a host.
SIZE_LIMITS = {"block_size": MAX_BLOCK_SIZE, "hidden_size": 1 << 17, "intermediate_size": 1 << 19,
               "num_hidden_layers": 1024, "num_attention_heads": 4096, "num_key_value_heads": 4096,
               "head_dim": 8192, "vocab_size": 1 << 24, "draft_vocab_size": 1 << 24, "num_target_layers": 4096,
               "target_hidden_size": 1 << 17, "max_position_embeddings": 1 << 26, "sliding_window": 1 << 26,
               "conv_kernel_size": MAX_BLOCK_SIZE, "conv_group_size": 1 << 17, "selector_rank": 1 << 17,
               "selector_top_k": 1 << 24}
ZLAB, SPECULATORS = "zlab", "speculators"          # mask rules
DFLASH2 = "dflash2"                                # the architectures: DFLASH and DFLASH2
MARKOV_HEADS = ("vanilla", "gated", "rnn")         # DSpark's previous-token heads
ATTENTION_MODES = ("gqa", "mha")                   # DSpark: grouped or equal query/KV heads


def raw_size_problems(raw: dict, where: str = "", depth: int = 0) -> list[str]:
    """The size fields of a config's JSON (nested sections included) outside 0..their limit."""
    out = []
    for key, value in raw.items():
        if isinstance(value, dict) and depth < 3:
            out += raw_size_problems(value, f"{where}{key}.", depth + 1)
        elif key in SIZE_LIMITS and isinstance(value, (int, float)) and not isinstance(value, bool) \
                and not 0 <= value <= SIZE_LIMITS[key]:
            out.append(f"{where}{key} {str(value)[:24]} is outside 0..{SIZE_LIMITS[key]}")
    return out


@dataclass(frozen=True)
class LayerRule:
    causal: bool               # block slots see only slots at positions <= their own
    window: int | None         # sliding window W (None: full attention)
    window_from: str           # "query": |q - k| < W (z-lab); "anchor": context c >= p - W (speculators)


@dataclass
class DrafterConfig:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_layer_ids: list[int]          # z-lab convention (see module docstring)
    mask_token_id: int
    vocab_size: int                      # rows of the target's embedding / lm_head
    block_size: int = 16
    num_target_layers: int | None = None  # decoder layers of the target it was trained for
    target_hidden_size: int | None = None  # defaults to hidden_size
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False
    rope_parameters: dict = field(default_factory=lambda: {"rope_type": "default", "rope_theta": 1_000_000.0})
    max_position_embeddings: int = 32768
    layer_types: list[str] = field(default_factory=list)  # FULL / SLIDING per layer
    sliding_window: int | None = None
    mask_rule: str = ZLAB                 # zlab | speculators (module docstring)
    is_causal: bool | None = None         # z-lab: overrides every layer's causality
    sliding_window_non_causal: bool = False  # speculators: bidirectional sliding layers
    sample_from_anchor: bool = False      # speculators: slot k predicts token p + k + 1
    draft_vocab_size: int | None = None   # speculators reduced vocabulary: own lm_head + d2t
    input_embedding_scale: float = 1.0    # z-lab knobs
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    architecture: str = DFLASH            # dflash | dflash2
    conv_kernel_size: int | None = None   # DFlash2
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    # SpecForge's families (remote/drafters/domino.py, dspark.py): a head after the DFlash backbone
    # that drafts a block's tokens one after another, each from the ones before it
    family: str = DFLASH                  # dflash | domino | dspark (SpecForge's projector_type)
    pure_draft_prefix_len: int = 0        # leading draft slots the head leaves as the backbone drafts them
    shift_label: bool = False             # Domino: the head reads slot k - 1 for token k
    emb_dim: int | None = None            # Domino: the correction MLP's width
    gru_hidden_dim: int | None = None     # Domino: the prefix GRU's state
    markov_rank: int = 0                  # DSpark: rank of the previous-token logit bias (0: none)
    markov_head_type: str = "vanilla"     # DSpark: vanilla | gated | rnn
    confidence_head: bool = False         # DSpark: a predicted acceptance per drafted position
    confidence_head_with_markov: bool = False   # DSpark: the confidence head also reads the previous token
    attention_mode: str = "gqa"           # DSpark: gqa | mha, as the head counts say

    def __post_init__(self):
        if not self.layer_types:
            self.layer_types = [FULL] * self.num_hidden_layers
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.rope_parameters = dict(self.rope_parameters)

    def size_problems(self) -> list[str]:
        """Each size field outside 1..its limit (SIZE_LIMITS), and a list of target layer ids
        longer than any target has layers (whether each id fits the target is inspect's check)."""
        out = [f"{name} {getattr(self, name)} is outside 1..{limit}" for name, limit in SIZE_LIMITS.items()
               if getattr(self, name) is not None and not 1 <= getattr(self, name) <= limit]
        if len(self.target_layer_ids) > SIZE_LIMITS["num_target_layers"]:
            out.append(f"{len(self.target_layer_ids)} target_layer_ids (at most {SIZE_LIMITS['num_target_layers']})")
        return out

    @property
    def sequential(self) -> bool:
        """Does a draft depend on the token drafted before it (DFlash2's selector, Domino, DSpark's
        Markov head)? Then drafts are chosen one after another, and a tree's children depend on
        their parent."""
        return self.architecture == DFLASH2 or self.family == DOMINO or (self.family == DSPARK and self.markov_rank > 0)

    @property
    def num_target_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def reduced_vocab(self) -> bool:
        return self.draft_vocab_size is not None and self.draft_vocab_size != self.vocab_size

    @property
    def num_drafts(self) -> int:
        """Draft tokens per block: ``B - 1`` (slot 0 is the anchor), ``B`` with sample_from_anchor."""
        return self.block_size if self.sample_from_anchor else self.block_size - 1

    @property
    def verify_block(self) -> int:
        """Tokens one verify forward checks: the last committed token and the drafts."""
        return self.num_drafts + 1

    def layer_rules(self) -> list[LayerRule]:
        rules = []
        for kind in self.layer_types:
            window = self.sliding_window if kind == SLIDING else None
            if self.mask_rule == ZLAB:
                causal = kind == SLIDING if self.is_causal is None else bool(self.is_causal)
                rules.append(LayerRule(causal, window, "query"))
            else:
                rules.append(LayerRule(kind == SLIDING and not self.sliding_window_non_causal, window, "anchor"))
        return rules

    def describe_rules(self) -> dict:
        """What ``inspect`` prints: the variant and the rules found in the checkpoint."""
        rules = self.layer_rules()
        return {"architecture": self.architecture, "mask_rule": self.mask_rule,
                "layers": [("causal" if r.causal else "bidirectional")
                           + (f", window {r.window} from the {r.window_from}" if r.window else "") for r in rules],
                "rope": self.rope_parameters, "sample_from_anchor": self.sample_from_anchor,
                "drafts_per_block": self.num_drafts,
                "vocab": (f"reduced: {self.draft_vocab_size} draft ids mapped to target ids through d2t"
                          if self.reduced_vocab else "full: the target's lm_head"),
                "knobs": {"input_embedding_scale": self.input_embedding_scale,
                          "output_multiplier": self.output_multiplier,
                          "final_logit_softcapping": self.final_logit_softcapping},
                **({"conv_kernel_size": self.conv_kernel_size, "conv_group_size": self.conv_group_size,
                    "selector_rank": self.selector_rank, "selector_top_k": self.selector_top_k}
                   if self.architecture == DFLASH2 else {}),
                "family": self.family, "sequential": self.sequential, "heads": self.heads(),
                "confidence_head": self.confidence_head}

    def heads(self) -> list[str]:
        """The family's heads after the backbone, as ``inspect`` names them."""
        if self.family == DOMINO:
            return [f"domino: a prefix GRU ({self.gru_hidden_dim}) over the block's earlier tokens and an MLP "
                    f"({self.emb_dim}) adding a correction to each draft's logits"]
        out = []
        if self.family == DSPARK and self.markov_rank:
            out.append(f"markov ({self.markov_head_type}, rank {self.markov_rank}): a previous-token logit bias")
        if self.confidence_head:
            out.append("confidence: a predicted acceptance per drafted position"
                       + (" (reading the previous token too)" if self.confidence_head_with_markov else ""))
        return out

    def transformers_config(self):
        """The ``Qwen3Config`` that transformers' parts (MLP, rotary embedding) are built from."""
        from transformers import Qwen3Config

        return Qwen3Config(hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
                           num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
                           num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
                           hidden_act=self.hidden_act, rms_norm_eps=self.rms_norm_eps,
                           rope_parameters=dict(self.rope_parameters),
                           max_position_embeddings=self.max_position_embeddings, vocab_size=self.vocab_size)

    def to_dict(self) -> dict:
        return asdict(self)
