"""Tokenizer directories for the tokenizer and prompt-splice tests: the default model's
(SmolLM2, ChatML), a Llama 3 style variant of it, one whose chat tokens strip the
whitespace around them, and a small trained Metaspace tokenizer (SentencePiece style,
prepending only at the start of the text)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim"
    " + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
LLAMA3_TOKENS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def default_tokenizer_dir(tmp: Path) -> Path:
    """The default model's tokenizer converted from its GGUF file and saved as relay's cache does."""
    from relaycli.models.registry import default_gguf_path
    from relaycli.models.tokenizer import ChatTokenizer

    out = tmp / "smollm2"
    ChatTokenizer.from_gguf(default_gguf_path(), [2]).save(out)
    return out


def _write(out: Path, tok: Tokenizer, config: dict, template_file: str | None = None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend", **config}))
    if template_file is not None:
        (out / "chat_template.jinja").write_text(template_file)
    return out


def llama3_dir(smol: Path, out: Path) -> Path:
    """SmolLM2's vocabulary with Llama 3's chat tokens added and a Llama 3 template in the config."""
    tok = Tokenizer.from_file(str(smol / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in LLAMA3_TOKENS])
    return _write(out, tok, {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>",
                             "chat_template": LLAMA3_TEMPLATE})


def stripping_dir(smol: Path, out: Path) -> Path:
    """SmolLM2 whose <|im_start|> strips whitespace on its right and <|im_end|> on its left,
    given as AddedToken-style dicts in the config."""
    data = json.loads((smol / "tokenizer.json").read_text())
    for entry in data["added_tokens"]:
        if entry["content"] == "<|im_start|>":
            entry["rstrip"] = True
        if entry["content"] == "<|im_end|>":
            entry["lstrip"] = True
    tok = Tokenizer.from_str(json.dumps(data))
    token = {"__type": "AddedToken", "content": "<|im_end|>", "lstrip": True, "normalized": False,
             "rstrip": False, "single_word": False, "special": True}
    return _write(out, tok, {"bos_token": "<|im_start|>", "eos_token": token}, CHATML_TEMPLATE)


def straddling_dir(smol: Path, out: Path) -> Path:
    """SmolLM2 plus an added token "\n<|im_start|>assistant" that reaches across the ChatML cut
    (right after "<|im_start|>") of rows whose first turn after the system is the assistant's."""
    tok = Tokenizer.from_file(str(smol / "tokenizer.json"))
    tok.add_special_tokens([AddedToken("\n<|im_start|>assistant", special=True, normalized=False)])
    return _write(out, tok, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}, CHATML_TEMPLATE)


def metaspace_dir(out: Path) -> Path:
    """A small BPE trained here: NFKC, Metaspace prepending "▁" only at offset 0, ChatML tokens."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    words = ("you are a helpful assistant answer briefly and kindly what is the capital of france "
             "hello there how are you today tell me a story about the sea numbers one two three").split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(300)]
    corpus += ["\n\n  tabs\tand newlines\n", "café naïve 中文 🙂 مرحبا"]
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"],
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    return _write(out, tok, {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "unk_token": "<unk>"},
                  CHATML_TEMPLATE)
