"""transformers ``generate`` rollout: the fallback backend when vLLM is not available."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hpcrl.rollout.base import Completion, SamplingSettings
from hpcrl.rollout.config import HFRolloutConfig


class HFEngine:
    def __init__(self, model_dir: Path, cfg: HFRolloutConfig, *, device: str = "cpu") -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device).eval()
        self.device = device
        self.cfg = cfg

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[list[Completion]]:
        torch = self.torch
        eos = self.tok.eos_token_id
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else eos
        gen = torch.Generator(device=self.device).manual_seed(settings.seed)
        groups: list[list[Completion]] = []
        rows = [p for p in prompts for _ in range(settings.n)]
        done: list[Completion] = []
        for start in range(0, len(rows), self.cfg.max_num_seqs):
            chunk = rows[start : start + self.cfg.max_num_seqs]
            done += self._generate_chunk(chunk, settings, gen, eos, pad)
        for i in range(len(prompts)):
            groups.append(done[i * settings.n : (i + 1) * settings.n])
        return groups

    def _generate_chunk(
        self, rows: list[list[int]], s: SamplingSettings, gen: Any, eos: int, pad: int
    ) -> list[Completion]:
        torch = self.torch
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, r in enumerate(rows):  # left padding so every row ends at the same position
            ids[i, width - len(r) :] = torch.tensor(r)
            attn[i, width - len(r) :] = 1
        out_ids: list[list[int]] = [[] for _ in rows]
        out_lp: list[list[float]] = [[] for _ in rows]
        finished = torch.zeros(len(rows), dtype=torch.bool)
        past = None
        x, mask = ids.to(self.device), attn.to(self.device)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            for _ in range(s.max_tokens):
                out = self.model(
                    input_ids=x,
                    attention_mask=mask,
                    position_ids=position,
                    past_key_values=past,
                    use_cache=True,
                )
                past = out.past_key_values
                logits = out.logits[:, -1].float()
                logp = torch.log_softmax(logits / max(s.temperature, 1e-5), dim=-1)
                if s.temperature == 0:
                    nxt = logits.argmax(-1)
                else:
                    nxt = torch.multinomial(logp.exp(), 1, generator=gen).squeeze(-1)
                chosen = torch.log_softmax(logits, dim=-1).gather(-1, nxt[:, None]).squeeze(-1)
                for i in range(len(rows)):
                    if not finished[i]:
                        out_ids[i].append(int(nxt[i]))
                        out_lp[i].append(float(chosen[i]))
                finished |= nxt.cpu() == eos
                if bool(finished.all()):
                    break
                x = nxt[:, None]
                mask = torch.cat([mask, torch.ones_like(x)], dim=1)
                position = position[:, -1:] + 1
        return [
            Completion(
                ids_, lps, str(self.tok.decode(ids_, skip_special_tokens=True)), truncated=bool(not fin)
            )
            for ids_, lps, fin in zip(out_ids, out_lp, finished.tolist(), strict=True)
        ]

    def load_weights(self, weights: dict[str, Any]) -> None:
        self.model.load_state_dict(weights, strict=False)
