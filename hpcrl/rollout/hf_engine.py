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
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        self.device = device
        self.cfg = cfg
        self.eos_id: int = int(self.tok.eos_token_id) if self.tok.eos_token_id is not None else -1
        self.pad_id: int = (
            int(self.tok.pad_token_id) if self.tok.pad_token_id is not None else max(self.eos_id, 0)
        )

    def generate(self, prompts: list[list[int]], settings: SamplingSettings) -> list[list[Completion]]:
        torch = self.torch
        eos = self.eos_id
        pad = self.pad_id
        gen = torch.Generator(device=self.device).manual_seed(settings.seed)
        self.model.generation_config.pad_token_id = pad
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
        tokens: list[Any] = []
        chosen_lps: list[Any] = []
        finished = torch.zeros(len(rows), dtype=torch.bool, device=self.device)
        past = None
        x, mask = ids.to(self.device), attn.to(self.device)
        position = (mask.cumsum(-1) - 1).clamp(min=0)
        with torch.no_grad():
            for step in range(s.max_tokens):
                out = self.model(input_ids=x, attention_mask=mask, position_ids=position, past_key_values=past,
                                 use_cache=True)  # fmt: skip
                past = out.past_key_values
                logits = out.logits[:, -1].float()
                if s.temperature == 0:
                    nxt = logits.argmax(-1)
                else:
                    probs = torch.softmax(logits / s.temperature, dim=-1)
                    nxt = torch.multinomial(probs, 1, generator=gen).squeeze(-1)
                nxt = torch.where(finished, torch.full_like(nxt, pad), nxt)
                tokens.append(nxt)
                chosen_lps.append(torch.log_softmax(logits, dim=-1).gather(-1, nxt[:, None]).squeeze(-1))
                finished |= nxt == eos
                # one host sync every 16 tokens instead of one per token
                if step % 16 == 15 and bool(finished.all()):
                    break
                x = nxt[:, None]
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

    def load_weights(self, weights: dict[str, Any]) -> None:
        self.model.load_state_dict(weights, strict=False)
