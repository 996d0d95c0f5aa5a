"""Gated DeltaNet layers in a tree verify: every node's short-convolution window and recurrent state
follow its own ancestors, so each node's output is the one a sequential forward over its own path
would give.

A tree verify feeds the target ``n`` nodes in tree order (node 0 the root, a parent before its
children) in one forward. Attention layers see the tree through the 4D mask; a Gated DeltaNet layer
has no mask: its causal conv would read a node's neighbours in the flattened order and its
recurrence would run through every node in turn. :class:`TreeLinearAttention` replaces the forward
of each such layer for the verify (installed on enter, removed on exit; transformers' code is not
changed) with the tree rule:

1. the per-token parts run once for all nodes: the input projections (``in_proj_qkv``, ``z``,
   ``b``, ``a``), the gates ``beta = sigmoid(b)`` and ``g = -exp(A_log) * softplus(a + dt_bias)``;
2. conv: node ``i``'s window is the ``K`` conv inputs before it on its path (its ancestors', then
   the cache's conv state, which holds the last ``K`` committed inputs), and its output is the
   model's own one-token conv step (``causal_conv1d_update``) from that window: all nodes at once,
   one window each;
3. recurrence, level by level: the root steps from the cache's recurrent state, a node at depth
   ``d`` from its parent's state after the parent's step; all nodes of a level in one call of the
   model's one-token delta-rule step (``torch_recurrent_gated_delta_rule``, or the kernel the
   model bound in its place), batched over the level's nodes, each row with its own initial state;
4. the output tail (gated RMS norm with ``z``, ``out_proj``) is per-token again.

Every node's output is therefore the arithmetic of a one-token decode step over its path, the same
functions the target runs when it decodes one token at a time. The verify leaves the cache's linear
state untouched and records each node's conv input and step inputs (``q, k, v, g, beta``, a few
hundred numbers per node and layer); :meth:`TreeLinearAttention.commit` then advances every linear
layer over the accepted path only: its conv state takes the path's inputs, its recurrent state
replays the path's steps from the cache's state (the same step function, in path order), and its
token counter moves by the path's length. No per-node state is kept past its level, so memory is
one level of states per layer at a time.

On a target split with a device_map (``--target-devices``: accelerate hooks on the modules), the
rule replaces the forward the mixer's hook wraps, not the hook: the hook still moves the inputs to
the layer's device and loads offloaded weights, and the conv weight the rule reads directly is
loaded for it as transformers' own forward has it loaded.

Only layers whose forward is Qwen3.5's (``Qwen3_5GatedDeltaNet`` and its MoE twin, the same code)
have this rule; :func:`tree_rule_problem` names any other linear-attention layer.
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from remote.target.cache import is_linear
from remote.target.model import decoder_layers

# Gated DeltaNet classes whose forward the tree rule reproduces (one code, two model families)
TREE_RULE_CLASSES = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet")
# what the rule reads and writes of a linear-attention cache layer (state index 0)
LINEAR_STATE = ("conv_states", "recurrent_states", "has_previous_state", "is_recurrent_states_initialized")


def linear_attention_modules(target) -> list:
    """The target's linear-attention token mixers, ``(layer index, module)``, in layer order."""
    out = []
    for i, layer in enumerate(decoder_layers(target)):
        mixer = getattr(layer, "linear_attn", None)
        if mixer is not None:
            out.append((i, mixer))
    return out


def tree_rule_problem(target, cache) -> str | None:
    """Why the target's linear-attention layers cannot be tree-verified exactly (one line), else None."""
    from transformers.cache_utils import DynamicLayer

    for i, mixer in linear_attention_modules(target):
        name = type(mixer).__name__
        if name not in TREE_RULE_CLASSES:
            return (f"DDTree online: layer {i} is a {name}, a linear-attention layer with no exact tree rule here "
                    f"(supported: {', '.join(TREE_RULE_CLASSES)})")
    for i, layer in enumerate(cache.layers):
        if is_linear(layer) and isinstance(layer, DynamicLayer):
            return f"DDTree online: cache layer {i} holds linear and attention state at once: no exact tree rule here"
        if is_linear(layer) and not all(hasattr(layer, name) for name in LINEAR_STATE):
            return (f"DDTree online: this transformers' linear-attention cache layer ({type(layer).__name__}) does not "
                    f"keep its state as {', '.join(LINEAR_STATE)}: no exact tree rule here")
    return None


def _kernels(mixer):
    """The conv and delta-rule step functions the mixer's own module calls (torch fallbacks on CPU,
    the kernels transformers bound where it bound them)."""
    module = sys.modules[type(mixer).__module__]
    return module.causal_conv1d_update, module.torch_recurrent_gated_delta_rule


def _forward_slot(mixer) -> str:
    """The attribute the tree rule's forward replaces: the module's ``forward``, or, under an
    accelerate hook (a target split with a device_map), the ``_old_forward`` the hook wraps, so
    the hook still moves the inputs and loads offloaded weights around the tree rule."""
    return "_old_forward" if hasattr(mixer, "_hf_hook") and hasattr(mixer, "_old_forward") else "forward"


@contextmanager
def _resident(module):
    """``module``'s own weights in memory for the block, as its forward would have them (an
    accelerate hook that offloads them loads them here; otherwise nothing is done)."""
    if getattr(module, "_hf_hook", None) is None:
        yield
        return
    from accelerate.utils import align_module_device
    with align_module_device(module):
        yield


@dataclass
class _Steps:
    """One layer's per-node record of a verify: conv inputs ``pre [n, C]`` and the delta-rule step
    inputs ``q, k [n, 1, Hk, dk]``, ``v [n, 1, Hv, dv]``, ``g, beta [n, 1, Hv]`` (batch = node)."""
    pre: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor


class TreeLinearAttention:
    """``with TreeLinearAttention(target, parents) as verify: forward(...)``, then
    ``verify.commit(cache, path)`` (module docstring). ``parents[i]`` is node ``i``'s parent, -1 for
    the root (node 0); a parent precedes its children."""

    def __init__(self, target, parents: list[int]):
        self.target = target
        self.parents = list(parents)
        self.depths = []
        for i, p in enumerate(self.parents):
            if (i == 0) != (p < 0) or p >= i:
                raise ValueError("tree order: node 0 is the root and every parent precedes its children")
            self.depths.append(0 if p < 0 else self.depths[p] + 1)
        # levels: the nodes at each depth, and the row of each one's parent in the level above
        self.levels: list[tuple[list[int], list[int]]] = []
        row: dict[int, int] = {}
        for depth in range(max(self.depths) + 1):
            nodes = [i for i, d in enumerate(self.depths) if d == depth]
            self.levels.append((nodes, [row[self.parents[i]] if depth else 0 for i in nodes]))
            row.update({node: r for r, node in enumerate(nodes)})
        self.steps: dict[int, _Steps] = {}
        self._installed: list = []

    def windows(self, kernel: int) -> torch.Tensor:
        """``[n, K]`` indices into ``[conv state (K columns), node inputs (n columns)]``: node ``i``'s
        ``K`` predecessors on its path, oldest first (the root's are the conv state's columns)."""
        chains: list[list[int]] = []
        for i, p in enumerate(self.parents):
            before = list(range(kernel)) if p < 0 else chains[p][1:] + [kernel + p]
            chains.append(before)
        return torch.tensor(chains, dtype=torch.long)

    def __enter__(self):
        for index, mixer in linear_attention_modules(self.target):
            slot = _forward_slot(mixer)
            self._installed.append((mixer, slot, mixer.__dict__.get(slot)))
            setattr(mixer, slot, self._forward_for(mixer, index))
        return self

    def __exit__(self, *exc):
        for mixer, slot, own in reversed(self._installed):
            if own is None:
                delattr(mixer, slot)
            else:
                setattr(mixer, slot, own)
        self._installed.clear()
        return False

    def _forward_for(self, mixer, index: int):
        conv_step, delta_step = _kernels(mixer)
        n = len(self.parents)

        def forward(hidden_states, cache=None, attention_mask=None, **kwargs):
            if hidden_states.shape[:2] != (1, n) or cache is None:
                raise ValueError(f"a tree verify is one batch of the {n} nodes, with the cache")
            layer = cache.layers[index]
            if not (layer.has_previous_state[0] and layer.is_recurrent_states_initialized[0]):
                raise ValueError("a tree verify continues a prefilled cache")
            x = hidden_states[0]                                             # [n, hidden]
            pre = mixer.in_proj_qkv(x)                                       # [n, C]
            z = mixer.in_proj_z(x).reshape(n, -1, mixer.head_v_dim)
            b, a = mixer.in_proj_b(x), mixer.in_proj_a(x)

            # conv: each node from its own window of K predecessors
            past = layer.conv_states[0][0]                                   # [C, K]
            kernel = past.shape[-1]
            inputs = torch.cat([past, pre.T.to(past.dtype)], -1)             # [C, K + n]
            windows = inputs[:, self.windows(kernel).to(inputs.device)].permute(1, 0, 2).contiguous()  # [n, C, K]
            with _resident(mixer.conv1d):
                mixed = conv_step(pre[:, :, None], windows, mixer.conv1d.weight.squeeze(1), mixer.conv1d.bias,
                                  activation=mixer.activation)[:, :, 0]      # [n, C]
            q, k, v = torch.split(mixed, [mixer.key_dim, mixer.key_dim, mixer.value_dim], dim=-1)
            q = q.reshape(n, 1, -1, mixer.head_k_dim)
            k = k.reshape(n, 1, -1, mixer.head_k_dim)
            v = v.reshape(n, 1, -1, mixer.head_v_dim)
            beta = b.sigmoid()[:, None]                                      # [n, 1, Hv]
            g = (-mixer.A_log.float().exp() * F.softplus(a.float() + mixer.dt_bias))[:, None]

            # recurrence: level by level, each node from its parent's state
            out, states = None, layer.recurrent_states[0]                    # [1, Hv, dk, dv]
            for nodes, parent_rows in self.levels:
                at = torch.tensor(nodes, device=x.device)
                o, states = delta_step(q[at], k[at], v[at], g=g[at], beta=beta[at],
                                       initial_state=states[torch.tensor(parent_rows, device=x.device)],
                                       output_final_state=True, use_qk_l2norm_in_kernel=True)
                if out is None:
                    out = o.new_empty((n, *o.shape[1:]))
                out[at] = o                                                  # [m, 1, Hv, dv]
            self.steps[index] = _Steps(pre, q, k, v, g, beta)

            core = mixer.norm(out.reshape(-1, mixer.head_v_dim), z.reshape(-1, mixer.head_v_dim))
            return mixer.out_proj(core.reshape(1, n, -1))

        return forward

    def commit(self, cache, path: list[int]) -> None:
        """Advance every linear layer over the nodes ``path`` (the root first, each the parent of the
        next): conv state, recurrent state and token counter as a sequential forward of those tokens
        leaves them. The cache's attention K/V are the caller's."""
        if not path or path[0] != 0 or any(self.parents[b] != a for a, b in zip(path, path[1:])):
            raise ValueError(f"not a path from the root: {path}")
        for index, mixer in linear_attention_modules(self.target):
            s, layer = self.steps[index], cache.layers[index]
            _, delta_step = _kernels(mixer)
            at = torch.tensor(path, device=s.pre.device)
            conv = layer.conv_states[0]
            conv.copy_(torch.cat([conv, s.pre[at].T[None].to(conv.dtype)], -1)[..., -conv.shape[-1]:])
            _, state = delta_step(*(t[at].transpose(0, 1) for t in (s.q, s.k, s.v)), g=s.g[at].transpose(0, 1),
                                  beta=s.beta[at].transpose(0, 1), initial_state=layer.recurrent_states[0],
                                  output_final_state=True, use_qk_l2norm_in_kernel=True)
            layer.recurrent_states[0].copy_(state)
            counter = getattr(layer, "cumulative_length_linear", None)      # the token counter, where kept
            if isinstance(counter, torch.Tensor):
                counter.add_(len(path))
            elif counter is not None:
                layer.cumulative_length_linear = counter + len(path)
