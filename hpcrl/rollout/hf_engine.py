"""transformers ``generate`` rollout: the fallback backend when vLLM is not available."""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from hpcrl.rollout.base import Completion, ImagePrompt, Prompt, RolloutEngine, SamplingSettings, WeightGate
from hpcrl.rollout.config import HFRolloutConfig


def sample_tokens(logits: Any, s: SamplingSettings, gen: Any, seen: Any = None) -> Any:
    """One token per row under ``s`` (``SamplingSettings`` gives the order, vLLM's): the repetition
    penalty on the tokens ``seen`` ([rows, vocab] bool), greedy at T = 0, else a sample of
    softmax(restricted logits / T). Gumbel-max: argmax of logits / T + Gumbel noise is an exact sample, in
    one pass (``multinomial`` is far slower on GPUs)."""
    import torch

    if seen is not None and s.repetition_penalty != 1.0:
        penalized = torch.where(logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty)
        logits = torch.where(seen, penalized, logits)
    if s.temperature == 0:
        return logits.argmax(-1)
    logits = restrict(logits / s.temperature, s.top_k, s.top_p, s.min_p)
    u = torch.rand(logits.shape, generator=gen, device=logits.device).clamp_(min=1e-20)
    return (logits - torch.log(-torch.log(u))).argmax(-1)


def restrict(logits: Any, top_k: int, top_p: float, min_p: float) -> Any:
    """``logits`` (already divided by the temperature) with -inf where min_p, then top_k, then top_p
    (over the top-k tokens' renormalized mass) leave a token out; the most likely token always stays."""
    import torch

    out = logits
    if min_p > 0:
        probs = out.softmax(-1)
        out = out.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
    if 0 < top_k < out.shape[-1]:
        kth = out.topk(top_k, dim=-1).values[..., -1:]
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p < 1.0:
        ordered, order = out.sort(-1, descending=True)
        probs = ordered.softmax(-1)
        # a token goes when the more likely ones already hold top_p of the mass (vLLM's rule)
        drop = (probs.cumsum(-1) - probs) >= top_p
        drop[..., 0] = False
        out = out.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), float("-inf"))
    return out


class HFEngine:
    def __init__(self, model_dir: Path, cfg: HFRolloutConfig, *, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        from hpcrl.rollout.decode_attention import register

        self.model = (
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=register())
            .to(device)
            .eval()
        )
        self.device = device
        self.cfg = cfg
        self.gate = WeightGate()
        """The policy version in place (stamped on completions); generation here is one call, so a
        refit never lands inside it."""
        self._static: dict[tuple[int, int], Any] = {}
        self.eos_id: int = int(self.tok.eos_token_id) if self.tok.eos_token_id is not None else -1
        self.pad_id: int = (
            int(self.tok.pad_token_id) if self.tok.pad_token_id is not None else max(self.eos_id, 0)
        )

    @classmethod
    def start(cls, model_dir: Path, cfg: HFRolloutConfig, *, on_cpu: bool, **_: Any) -> HFEngine:
        """``build_engine``'s way in (the settings only vLLM reads are left aside)."""
        return cls(model_dir, cfg, device="cpu" if on_cpu else "cuda")

    def generate_stream(
        self, prompts: list[Prompt], settings: SamplingSettings
    ) -> Iterator[list[tuple[int, list[Completion]]]]:
        """The whole batch at once: one call generates every group together."""
        yield list(enumerate(self.generate(prompts, settings)))

    def generate(self, prompts: list[Prompt], settings: SamplingSettings) -> list[list[Completion]]:
        torch = self.torch
        eos = self.eos_id
        pad = self.pad_id
        gen = torch.Generator(device=self.device).manual_seed(settings.seed)
        self.model.generation_config.pad_token_id = pad
        groups: list[list[Completion]] = []
        rows = [p for p in text_prompts(prompts) for _ in range(settings.n)]
        done: list[Completion] = []
        for start in range(0, len(rows), self.cfg.max_num_seqs):
            chunk = rows[start : start + self.cfg.max_num_seqs]
            done += self._generate_chunk(chunk, settings, gen, eos, pad)
        for i in range(len(prompts)):
            groups.append(done[i * settings.n : (i + 1) * settings.n])
        for c in done:
            c.versions = (self.gate.version, self.gate.version)
        return groups

    def _generate_chunk(
        self, rows: list[list[int]], s: SamplingSettings, gen: Any, eos: int, pad: int
    ) -> list[Completion]:
        torch = self.torch
        static = self._use_static()
        width = max(len(r) for r in rows)
        if static:  # prompt widths in steps of 64: a handful of cache shapes, each compiled once
            width = -(-width // 64) * 64
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(rows):  # left padding so every row ends at the same position
            ids[i, width - len(r) :] = torch.tensor(r)
            attn[i, width - len(r) :] = 1
        tokens: list[Any] = []
        chosen_lps: list[Any] = []
        finished = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        past = None
        x, mask = ids.to(self.device), attn.to(self.device)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        forward = self._static_forward(mask, s.max_tokens) if static else self._dynamic_forward
        seen = None  # the repetition penalty's tokens so far: the prompt's, then each one sampled
        with torch.no_grad():
            for step in range(s.max_tokens):
                logits, past = forward(x, mask, position, past, step)
                logits = logits.float()
                if s.repetition_penalty != 1.0 and seen is None:
                    # counted, not scattered as bools: a padding slot must not unmark a real token
                    counts = torch.zeros(logits.shape, dtype=torch.long, device=self.device)
                    seen = counts.scatter_add_(1, x, mask.long()) > 0
                nxt = sample_tokens(logits, s, gen, seen)
                nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
                if seen is not None:
                    seen.scatter_(1, nxt[:, None], True)
                tokens.append(nxt)
                # log p(token) under the policy itself (T = 1), what the trainer computes
                chosen_lps.append(
                    logits.gather(-1, nxt[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)
                )
                finished |= nxt == eos
                # one host sync every 16 tokens instead of one per token
                if step % 16 == 15 and bool(finished.all()):
                    break
                x = nxt[:, None]
                if not static:  # the static path's mask already spans the whole cache
                    mask = torch.cat([mask, torch.ones_like(x)], dim=1)
                position = position[:, -1:] + 1
        all_ids = torch.stack(tokens, 1).cpu().tolist()
        all_lps = torch.stack(chosen_lps, 1).float().cpu().tolist()
        done: list[Completion] = []
        for row_ids, row_lps in zip(all_ids, all_lps, strict=True):
            end = row_ids.index(eos) + 1 if eos in row_ids else len(row_ids)
            ids_ = row_ids[:end]
            text = str(self.tok.decode(ids_, skip_special_tokens=True))
            done.append(Completion(ids_, row_lps[:end], text, truncated=eos not in row_ids))
        return done

    def _use_static(self) -> bool:
        return bool(self.cfg.static_cache) and str(self.device).startswith("cuda")

    def _dynamic_forward(self, x: Any, mask: Any, position: Any, past: Any, step: int) -> tuple[Any, Any]:
        out = self.model(
            input_ids=x, attention_mask=mask, position_ids=position, past_key_values=past, use_cache=True
        )
        return out.logits[:, -1], out.past_key_values

    def _static_forward(self, prompt_mask: Any, max_tokens: int) -> Any:
        """A forward over a preallocated cache with fixed shapes: the prompt once, then one token per
        call through a compiled step (CUDA-graph replay). The mask covers the whole cache: left padding
        0, everything else 1 (the causal mask, by cache position, hides what is not written yet).
        Cache, mask and compiled step are kept per (batch, length) shape and reused, so each shape
        compiles once per engine, not once per step."""
        from transformers import StaticCache

        torch = self.torch
        rows, width = prompt_mask.shape
        length = width + max_tokens
        if (rows, length) not in self._static:
            cache = StaticCache(config=self.model.config, max_cache_len=length)
            full = torch.ones((rows, length), dtype=prompt_mask.dtype, device=self.device)
            model = self.model

            def step_fn(tok: Any, pos: Any, cache_pos: Any) -> Any:
                return model(
                    input_ids=tok,
                    attention_mask=full,
                    position_ids=pos,
                    past_key_values=cache,
                    cache_position=cache_pos,
                    use_cache=True,
                ).logits[:, -1]

            # Each shape is a recompilation of the same step: past dynamo's default limit (8) it would
            # silently fall back to eager, ~2x slower per token.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._static[(rows, length)] = (cache, full, torch.compile(step_fn, mode="reduce-overhead"))
        cache, full, compiled = self._static[(rows, length)]
        cache.reset()
        full.fill_(1)
        full[:, :width] = prompt_mask

        def forward(x: Any, mask: Any, position: Any, past: Any, step: int) -> tuple[Any, Any]:
            if step == 0:
                # The prompt's own mask, not the whole cache's: transformers pads a short 2D mask
                # with zeros to the cache length for attention (nothing there yet either way), and
                # Mamba layers mask their inputs with its last ``width`` columns, which of ``full``
                # would be ones and let the left padding into the recurrent state.
                out = self.model(
                    input_ids=x,
                    attention_mask=full[:, :width],
                    position_ids=position,
                    past_key_values=cache,
                    cache_position=torch.arange(width, device=self.device),
                    use_cache=True,
                )
                return out.logits[:, -1], cache
            cache_pos = torch.full((1,), width + step - 1, dtype=torch.long, device=self.device)
            return compiled(x, position, cache_pos).clone(), cache  # clone: the graph reuses its output

        return forward

    @property
    def weight_dtype(self) -> str:
        return "bfloat16" if self.device.startswith("cuda") else "float32"

    ranks = 1
    """Ranks this engine takes in the weight group (one process)."""

    def join_weight_group(self, wire: dict[str, Any], rank_base: int, local_ip: str) -> None:
        from hpcrl.sync.broadcast import WeightLayout, join_as_receiver

        layout = WeightLayout.from_wire(wire)
        self._receiver = join_as_receiver(layout, rank_base, self.device, local_ip)

    def receive_weights(self) -> dict[str, float]:
        def load() -> None:
            for bucket in self._receiver.receive_buckets():  # one bucket at a time beside the model
                self.load_weights(bucket)

        return self._receiver.timed(load)

    def load_ipc(self, args: Any, entries: list[Any]) -> None:
        """One bucket from the trainer on this GPU (CUDA IPC): copied into the model, then let go."""
        import torch
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(args)
        args[6] = torch.cuda.current_device()  # storage_device: the same GPU, maybe numbered otherwise here
        buf = rebuild_cuda_tensor(*args)
        self.load_weights({n: buf[o : o + math.prod(s)].view(tuple(s)) for n, s, o in entries})
        torch.cuda.synchronize()
        del buf

    def finish_refit(self) -> None:
        """Nothing cached across generations."""

    def prefix_cache_counts(self) -> tuple[int, int] | None:
        return None  # each call starts its KV afresh

    def sleep(self) -> None:
        """The hf engine has no sleep mode."""

    def wake_up(self, tags: list[str] | None = None) -> None:
        """The hf engine has no sleep mode."""

    def load_weights(self, weights: dict[str, Any]) -> None:
        """Weights arrive in checkpoint names (both trainers export those); this model may hold some
        under other names or fused (Nemotron-H's ``backbone.*`` is ``model.*`` in memory, an MoE
        layer's experts one tensor). Each lands in the model's own tensor, cast to its dtype; every
        one must land somewhere: a name that matches nothing would otherwise leave the engine
        generating with stale weights."""
        import torch

        views = checkpoint_views(self.model)
        state = self.model.state_dict()
        # what transformers' conversion cannot view (gate|up halves of fused experts): by name
        fused = fuse_experts({k: v for k, v in weights.items() if k not in views}, state)
        unknown = sorted(set(fused) - set(state))
        if unknown:
            raise KeyError(
                f"hf engine: {len(unknown)} received weights match no parameter of "
                f"{type(self.model).__name__}, e.g. {unknown[:3]}"
            )
        with torch.no_grad():
            for name, tensor in weights.items():
                if name in views:
                    views[name].copy_(tensor)
        self.model.load_state_dict(fused, strict=False)


def checkpoint_views(model: Any) -> dict[str, Any]:
    """Checkpoint name -> a view into the model tensor (parameter or buffer) that holds it:
    transformers' save-time conversion (renames, fused experts split per expert) run on the live
    tensors, so writing a view writes the model. Only true views are kept: a conversion that copies
    (``Chunk`` makes its halves contiguous) would silently drop every write."""
    from transformers.core_model_loading import revert_weight_conversion

    state = model.state_dict()
    storages = {t.untyped_storage().data_ptr() for t in state.values()}
    views = dict(revert_weight_conversion(model, state))
    return {k: v for k, v in views.items() if v.untyped_storage().data_ptr() in storages}


EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")


def fuse_experts(weights: dict[str, Any], state: dict[str, Any]) -> dict[str, Any]:
    """Per-expert checkpoint tensors (``...experts.<e>.gate_proj.weight``) written into the model's
    fused ones (``...experts.gate_up_proj`` [E, 2I, H] = gate|up, ``...experts.down_proj`` [E, H, I]),
    starting from the model's current values so a partial update keeps the rest."""
    out: dict[str, Any] = {}
    for name, tensor in weights.items():
        m = EXPERT.match(name)
        if m is None or name in state:
            out[name] = tensor
            continue
        prefix, e, kind = m.group(1), int(m.group(2)), m.group(3)
        target = f"{prefix}.down_proj" if kind == "down" else f"{prefix}.gate_up_proj"
        if target not in state:
            out[name] = tensor  # no fused tensor to put it in: reported as unknown
            continue
        fused = out.setdefault(target, state[target].detach().clone())
        half = fused.shape[1] // 2
        rows = {"gate": slice(0, half), "up": slice(half, None), "down": slice(None)}[kind]
        fused[e, rows] = tensor.to(fused.dtype)
    return out


def text_prompts(prompts: list[Prompt]) -> list[list[int]]:
    """The prompts as token ids; images are for engines whose spec says they take them (the config
    refuses ``data.image_field`` with ``rollout=hf``)."""
    texts = [p for p in prompts if not isinstance(p, ImagePrompt)]
    if len(texts) != len(prompts):
        raise ValueError("rollout=hf generates from text prompts only; image prompts need rollout=vllm")
    return texts


def _fits_the_protocol(engine: HFEngine) -> RolloutEngine:
    """mypy checks here that the engine is a ``RolloutEngine``."""
    return engine
