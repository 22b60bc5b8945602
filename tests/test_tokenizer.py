"""ChatTokenizer on `tokenizers` + jinja2 against transformers: rendered text, ids, decoded
text, special-token ids, vocabulary size and fingerprints; saving and loading; bad
directories; and that none of it imports transformers."""

from __future__ import annotations

import hashlib
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from relaycli.models.tokenizer import ChatTokenizer, TokenizerError
from tests import helpers_tokenizers as H

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a colour."}],
    [{"role": "system", "content": "  Sé breve 🙂\n"}, {"role": "user", "content": "\n\n  hi <|im_end|> <|eot_id|>\t"},
     {"role": "assistant", "content": " Hello.\n"}, {"role": "user", "content": "中文 e\u0301 مرحبا \r\n"}],
    [{"role": "user", "content": "<|im_start|>user\nx<|im_end|>"}, {"role": "assistant", "content": "ok"},
     {"role": "user", "content": " "}],
    [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": "", "thinking": None},
     {"role": "user", "content": "{{ bos_token }} {% raw %}"}],
]


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("toks")
    smol = H.default_tokenizer_dir(tmp)
    return {"chatml": smol, "llama3": H.llama3_dir(smol, tmp / "llama3"),
            "stripping": H.stripping_dir(smol, tmp / "stripping"), "metaspace": H.metaspace_dir(tmp / "metaspace")}


@pytest.mark.parametrize("name", ["chatml", "llama3", "stripping", "metaspace"])
def test_same_text_ids_and_decoding_as_transformers(dirs, name):
    ours = ChatTokenizer.from_dir(dirs[name], [7])
    ref = transformers.AutoTokenizer.from_pretrained(str(dirs[name]), local_files_only=True)
    for chat in CHATS:
        for gen in (True, False):
            text = ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
            ids = ref.apply_chat_template(chat, tokenize=True, add_generation_prompt=gen, return_dict=True)["input_ids"]
            assert ours.render_text(chat, add_generation_prompt=gen) == text
            assert ours.render(chat, add_generation_prompt=gen) == list(ids)
            assert ours.encode(text) == ref(text, add_special_tokens=False)["input_ids"]
            assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    rng = random.Random(name)
    for _ in range(50):  # arbitrary ids, special ones among them, decode alike
        ids = [rng.randrange(ours.vocab_size) for _ in range(rng.randint(1, 30))]
        assert ours.decode(ids) == ref.decode(ids, skip_special_tokens=True)
    assert ours.vocab_size == len(ref)
    assert ours.eos_token_ids == {ref.eos_token_id, 7}
    assert ours.fingerprint() == hashlib.sha256(ref.backend_tokenizer.to_str().encode()).hexdigest()
    assert ours.template_fingerprint() == hashlib.sha256(ref.chat_template.encode()).hexdigest()


def test_gguf_conversion_saves_and_loads_back_identically(dirs, tmp_path):
    from relaycli.models.registry import default_gguf_path

    gguf = default_gguf_path()
    first = ChatTokenizer.from_gguf(gguf, [2])
    ref = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    again = ChatTokenizer.from_dir(dirs["chatml"], [2])
    for tok in (first, again):
        assert tok.fingerprint() == hashlib.sha256(ref.backend_tokenizer.to_str().encode()).hexdigest()
        assert tok.template_fingerprint() == hashlib.sha256(ref.chat_template.encode()).hexdigest()
        assert tok.special_tokens == ref.special_tokens_map and tok.eos_token_ids == {2}
        assert tok.pad_token_id == ref.pad_token_id and tok.vocab_size == len(ref) == 49152
        for chat in CHATS:
            assert tok.render(chat) == list(ref.apply_chat_template(chat, add_generation_prompt=True,
                                                                   return_dict=True)["input_ids"])
    again.save(tmp_path / "copy")
    copy = ChatTokenizer.from_dir(tmp_path / "copy", [2])
    assert (copy.fingerprint(), copy.template_fingerprint(), copy.special_tokens) == \
        (again.fingerprint(), again.template_fingerprint(), again.special_tokens)
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == \
        ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"]


def test_template_environment_matches_transformers(dirs, tmp_path):
    """raise_exception, tojson (no HTML escaping, non-ASCII kept), namespace, loop controls,
    the generation tag, dict() and model-specific `*_token` variables."""
    template = ("{% set ns = namespace(n=0) %}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
                "{% set ns.n = ns.n + 1 %}{% generation %}{{ m | tojson }}{% endgeneration %}\n"
                "{{ dict(a=1) | tojson(indent=1) }}{% if m.content == 'stop' %}{% break %}{% endif %}{% endfor %}"
                "{{ ns.n }} {{ image_token }} {{ eos_token }}"
                "{% if messages[0].content == 'boom' %}{{ raise_exception('no boom') }}{% endif %}")
    out = tmp_path / "features"
    out.mkdir()
    (out / "tokenizer.json").write_bytes((dirs["chatml"] / "tokenizer.json").read_bytes())
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "TokenizersBackend",
                                                           "eos_token": "<|im_end|>", "image_token": "<|im_start|>",
                                                           "chat_template": template}))
    ours = ChatTokenizer.from_dir(out)
    ref = transformers.AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    chat = [{"role": "user", "content": "<b>&é\"</b>"}, {"role": "skip", "content": "x"},
            {"role": "assistant", "content": "stop"}, {"role": "user", "content": "never"}]
    assert ours.render_text(chat) == ref.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    assert '"<b>&é\\"</b>"' in ours.render_text(chat) and ours.render_text(chat).endswith("2 <|im_start|> <|im_end|>")
    import jinja2
    with pytest.raises(jinja2.TemplateError, match="no boom"):
        ours.render_text([{"role": "user", "content": "boom"}])


def test_legacy_special_tokens_map_and_chat_template_json(dirs, tmp_path):
    out = tmp_path / "legacy"
    out.mkdir()
    (out / "tokenizer.json").write_bytes((dirs["chatml"] / "tokenizer.json").read_bytes())
    (out / "tokenizer_config.json").write_text("{}")
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>", "lstrip": False},
                                                             "bos_token": "<|im_start|>", "pad_token": "<pad>"}))
    (out / "chat_template.json").write_text(json.dumps({"chat_template": H.CHATML_TEMPLATE}))
    tok = ChatTokenizer.from_dir(out)
    assert tok.eos_token_ids == {2} and tok.chat_template == H.CHATML_TEMPLATE
    assert tok.pad_token_id == 49152 and tok.vocab_size == 49153  # "<pad>" is added as transformers adds it
    assert tok.encode("a<pad>") == tok.encode("a") + [49152]


def test_unusable_directories_are_refused_with_the_fix(dirs, tmp_path):
    with pytest.raises(TokenizerError, match=f"{tmp_path}: no tokenizer.json there"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="tokenizer.json: not a readable tokenizers file .*re-save"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer.json").write_bytes((dirs["chatml"] / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("[1, 2")
    with pytest.raises(TokenizerError, match="tokenizer_config.json: not readable JSON"):
        ChatTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("{}")
    tok = ChatTokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerError, match="has no chat template; relay needs one"):
        tok.render([{"role": "user", "content": "hi"}])
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }")
    with pytest.raises(TokenizerError, match="the chat template is not valid Jinja .*fix the template"):
        ChatTokenizer.from_dir(tmp_path).render([{"role": "user", "content": "hi"}])


def test_loading_rendering_and_decoding_do_not_import_transformers(dirs):
    code = f"""
import sys
from pathlib import Path
from relaycli.models.tokenizer import ChatTokenizer
from relaycli.prompts import PromptMatcher
from relaycli.compile import shared_prefix_ids
tok = ChatTokenizer.from_dir(Path({str(dirs["chatml"])!r}), [2])
chat = [{{"role": "system", "content": "Be brief."}}, {{"role": "user", "content": "hi"}}]
ids = tok.render(chat)
assert tok.decode(ids) and tok.fingerprint() and tok.vocab_size == 49152

class Art:
    name, system_text = "a", "Be brief."
    token_ids = shared_prefix_ids(tok, "Be brief.")

got = PromptMatcher(tok, [Art()]).prepare(chat[1:], None)
assert got.prompt_ids == ids and got.prefix_slot == 0 and not got.full_render
bad = sorted(m for m in sys.modules if m.split(".")[0] in ("transformers", "sklearn", "sympy"))
print("IMPORTED", bad)
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "IMPORTED []" in out.stdout, out.stdout
