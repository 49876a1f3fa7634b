"""Data files and batches.

Files: prompts (.txt, one per line, or .jsonl with "prompt"), pseudo-labels written by the teacher
(.jsonl: "prompt_ids", "response_ids"), SFT pairs (.jsonl: "prompt", "response"), preference
pairs (.jsonl: "prompt", "chosen", "rejected") and plain text (.txt, cut into token blocks).

An example is (input_ids, labels) with labels[t] the token after t, IGNORE on prompt tokens.
"""

import json
from pathlib import Path

import torch

from hybrid_train.errors import TrainError
from hybrid_train.losses import IGNORE


def read_text(path: str | Path, what: str = "data file") -> str:
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"{what} not found: {path}")
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise TrainError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def read_jsonl(path: str | Path, keys: tuple[str, ...]) -> list[dict]:
    rows = []
    for n, line in enumerate(read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise TrainError(f"{path}:{n}: not valid JSON ({e})") from None
        missing = [k for k in keys if k not in row]
        if missing:
            raise TrainError(f"{path}:{n}: missing field '{missing[0]}'")
        rows.append(row)
    if not rows:
        raise TrainError(f"{path} holds no examples")
    return rows


def read_prompts(path: str | Path) -> list[str]:
    if Path(path).suffix == ".jsonl":
        return [row["prompt"] for row in read_jsonl(path, ("prompt",))]
    prompts = [line.strip() for line in read_text(path, "prompt file").splitlines() if line.strip()]
    if not prompts:
        raise TrainError(f"{path} holds no prompts")
    return prompts


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    """Token ids of a prompt: as a user turn with the generation prompt (chat), else plain text."""
    if chat:
        if not tokenizer.chat_template:
            raise TrainError("chat: true, but the teacher's tokenizer has no chat template")
        messages = [{"role": "user", "content": prompt}]
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    return tokenizer(prompt, add_special_tokens=True).input_ids


def example(prompt_ids: list[int], response_ids: list[int], seq_len: int) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of a prompt and its response, cut to seq_len tokens; loss on the response."""
    ids = (prompt_ids + response_ids)[:seq_len]
    labels = [IGNORE] * (len(prompt_ids) - 1) + response_ids + [IGNORE]
    return ids, labels[: len(ids)]


def text_blocks(tokenizer, paths: list[str], seq_len: int) -> list[tuple[list[int], list[int]]]:
    """Plain text cut into blocks of seq_len tokens (documents = non-empty lines), loss on every token."""
    ids = []
    for path in paths:
        for line in read_text(path, "text file").splitlines():
            if line.strip():
                ids += tokenizer(line.strip(), add_special_tokens=False).input_ids
                if tokenizer.eos_token_id is not None:
                    ids.append(tokenizer.eos_token_id)
    blocks = [ids[i : i + seq_len + 1] for i in range(0, len(ids) - 1, seq_len)]
    blocks = [b for b in blocks if len(b) == seq_len + 1]
    if not blocks:
        raise TrainError(f"{', '.join(map(str, paths))}: fewer than {seq_len + 1} tokens of text")
    return [(b[:-1], b[1:]) for b in blocks]


def collate(examples: list[tuple[list[int], list[int]]], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded input_ids and labels. Causal layers never see the padding of later positions."""
    width = max(len(ids) for ids, _ in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for i, (x, y) in enumerate(examples):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
    return {"input_ids": ids, "labels": labels}

