"""The generate CLI end to end on a tiny HF folder with a real byte-level BPE tokenizer."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from builders import CHAT_TEMPLATE, write_chat_pair

ROOT = Path(__file__).resolve().parents[1]
@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    write_chat_pair(target_dir, draft_dir)
    return target_dir, draft_dir


def _cli_env(**extra) -> dict:
    """A bare environment for a generate subprocess (plus ``extra``); compiled programs kept in the
    suite's folder and compiled with the suite's flags (conftest)."""
    return {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "XLA_FLAGS": os.environ["XLA_FLAGS"],
            "XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"], **{k: str(v) for k, v in extra.items()}}


def _cli(*args, timeout=900, **env):
    return subprocess.run([sys.executable, "-m", "dflash_jax.generate", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, env=_cli_env(**env))


def test_cli_streams_dflash_and_matches_baseline(model_dirs, tmp_path):
    target_dir, draft_dir = model_dirs
    stats = tmp_path / "stats.json"
    run = _cli("--target", target_dir, "--draft", draft_dir, "--prompt", "def fib", "--max-new-tokens", 12,
               "--baseline", "--dtype", "float32", "--stats-json", stats)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("def fib")
    assert "outputs identical: True" in run.stderr
    summary = json.loads(stats.read_text())
    assert summary["dflash"]["new_tokens"] == summary["plain"]["new_tokens"]
    assert sum(summary["dflash"]["histogram"]) == sum(summary["dflash"]["steps"])


def test_cli_batch_file_and_chat(model_dirs, tmp_path):
    """A .jsonl of a text prompt (one user turn after --system) and a several-turn chat, under --chat:
    rendered through the template, and printed as given."""
    from dflash_jax.loading.tokenizer import Tokenizer, render_prompts

    target_dir, _ = model_dirs
    prompts = tmp_path / "prompts.jsonl"
    turns = [{"role": "user", "content": "def a"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "class B"}]
    prompts.write_text(json.dumps({"prompt": "def a"}) + "\n" + json.dumps({"messages": turns}) + "\n")
    run = _cli("--target", target_dir, "--batch-file", prompts, "--chat", "--system", "be brief",
               "--no-thinking", "--max-new-tokens", 5, "--temperature", 0.8, "--top-k", 20)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith(f'=== {prompts}:1 "def a"\n')
    assert f"\n=== {prompts}:2 {json.dumps(turns)}\n" in run.stdout and "<|im_start|>" not in run.stdout
    rendered = "".join(render_prompts(Tokenizer(target_dir), ["def a", turns], chat=True, system="be brief",
                                      enable_thinking=False, flag="--batch-file"))
    assert rendered.count("<|im_start|>user") == 3
    assert rendered.count("<|im_start|>system\nbe brief") == 1  # only before the text prompt
    assert rendered.count("<|im_start|>assistant\nok") == 1 and rendered.count("<think>") == 2


@pytest.mark.parametrize("args, message", [
    (["--target", "/nonexistent"], "not found"),
    (["--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
    (["--top-p", "0"], "--top-p must be in (0, 1], got 0.0"),
    (["--block-size", "9"], "--block-size must be in [2, 4] (the draft's trained block size), got 9"),
    (["--block-size", "0"], "--block-size must be in [2, 4] (the draft's trained block size), got 0"),
    (["--prompt", ""], "--prompt is empty"),
    (["--temperature", "nan"], "--temperature must be a finite number >= 0, got nan"),
    (["--seed", str(2**32)], "seed must be an integer in [0, 2**32), got 4294967296"),
    (["--seed", "-1"], "seed must be an integer in [0, 2**32), got -1"),
])
def test_cli_errors_are_one_line(model_dirs, args, message):
    target_dir, draft_dir = model_dirs
    base = [] if args[0] == "--target" else ["--target", target_dir, "--draft", draft_dir]
    run = _cli(*base, *args)
    assert run.returncode == 2
    assert message in run.stderr and "Traceback" not in run.stderr
    assert run.stdout == ""  # the error comes before the prompt would be echoed


def test_cli_without_model_explains_what_to_pass(monkeypatch):
    from dflash_jax.entrypoints import generate

    monkeypatch.setattr(generate, "DEFAULT_MODEL", ROOT / "no-such-default")
    assert generate.main([]) == 2


def test_cli_baseline_names_the_first_difference(model_dirs, monkeypatch, capsys):
    """When the --baseline outputs differ, the CLI says where, and why bf16 can flip a near-tie."""
    from dflash_jax.entrypoints import generate
    from dflash_jax.runtime.engine import Engine

    class PlainDiffers(Engine):  # the plain run's third new token changed
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            emit = self.output.emit

            def changed(request, new, steps, reason):
                at = 2 - len(request.token_ids)
                if self.draft is None and 0 <= at < len(new):
                    new = [*new[:at], new[at] ^ 1, *new[at + 1:]]
                emit(request, new, steps, reason)

            self.output.emit = changed

    monkeypatch.setattr("dflash_jax.runtime.generation.Engine", PlainDiffers)
    target_dir, draft_dir = model_dirs
    assert generate.main(["--target", str(target_dir), "--draft", str(draft_dir), "--max-new-tokens", "6",
                          "--baseline", "--dtype", "bfloat16", "--impl", "reference"]) == 0
    err = capsys.readouterr().err
    assert "outputs identical: False" in err
    assert ("[compare] first difference: sequence 0, new token 2; in bfloat16 a block verify and a "
            "one-token decode round differently") in err


def _reject_nan(constant):
    raise AssertionError(f"invalid JSON constant {constant}")


def test_cli_one_new_token_reports_undefined_stats_as_na(model_dirs, tmp_path, capsys):
    """Nothing is decoded after the first token: tau and the speedup are undefined, not errors."""
    from dflash_jax.entrypoints import generate
    from dflash_jax.loading.models import load_target

    target_dir, draft_dir = model_dirs
    stats = tmp_path / "stats.json"
    # --impl reference: this tiny model's head_dim (8) is too small for the GPU kernels auto picks there
    assert generate.main(["--target", str(target_dir), "--draft", str(draft_dir), "--max-new-tokens", "1",
                          "--baseline", "--dtype", "float32", "--impl", "reference", "--stats-json", str(stats)]) == 0
    err = capsys.readouterr().err
    assert "tau (mean accepted length, bonus included) n/a over 0 steps" in err
    assert "speedup n/a over plain decoding; outputs identical: True" in err
    assert f"reading {target_dir.name}: 100%" in err and f"reading {draft_dir.name}: 100%" in err
    assert "[plain] 1 tokens, n/a tok/s decode" in err
    summary = json.loads(stats.read_text(), parse_constant=_reject_nan)
    assert summary["dflash"]["tau"] is None and summary["plain"]["tau"] is None
    assert summary["dflash"]["tokens_per_second"] is None and summary["plain"]["tokens_per_second"] is None
    assert summary["speedup"] is None and summary["dflash"]["new_tokens"] == [1]
    load_target(target_dir, "float32")  # the library stays quiet by default
    assert capsys.readouterr().err == ""


def _tokenizer_folder(tmp_path, **files):
    """The embedded model's tokenizer.json plus the given side files (name -> text)."""
    import shutil

    from dflash_jax.entrypoints import generate

    shutil.copy(generate.DEFAULT_MODEL / "target" / "tokenizer.json", tmp_path / "tokenizer.json")
    for name, text in files.items():
        (tmp_path / f"{name}.json").write_text(text)
    return tmp_path


def test_tokenizer_side_file_forms(tmp_path):
    """A list of named chat templates (the 'default' one renders), {% break %}, null eos entries."""
    from dflash_jax.loading.tokenizer import Tokenizer

    template = ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}<{{ m.role }}>"
                "{{ m.content }}{% endfor %}{% if add_generation_prompt %}<bot>{% endif %}")
    config = {"chat_template": [{"name": "tool_use", "template": "tools"},
                                {"name": "default", "template": template}]}
    folder = _tokenizer_folder(tmp_path, tokenizer_config=json.dumps(config),
                               generation_config='{"eos_token_id": [0, null]}')
    tokenizer = Tokenizer(folder)
    assert tokenizer.apply_chat_template("hi") == "<user>hi<bot>"
    assert tokenizer.stop_token_ids == [0]


def test_chat_template_from_a_multimodal_release_s_chat_template_json(tmp_path):
    """A release whose template lives only in chat_template.json (a processor's, as Qwen3.5's
    multimodal releases save it) renders it; tokenizer_config.json's wins where both have one."""
    from dflash_jax.loading.tokenizer import Tokenizer

    folder = _tokenizer_folder(tmp_path, chat_template=json.dumps({"chat_template": "<u>{{ messages[0].content }}"}),
                               tokenizer_config="{}")
    assert Tokenizer(folder).apply_chat_template("hi") == "<u>hi"
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": "<v>{{ messages[0].content }}"}))
    assert Tokenizer(folder).apply_chat_template("hi") == "<v>hi"


def test_chat_template_generation_tag_and_special_tokens_map(tmp_path):
    """As transformers renders them: {% generation %} (assistant-only-loss templates) renders its
    body, and special tokens named only in special_tokens_map.json reach the template
    (tokenizer_config.json's win where both name one)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    from dflash_jax.loading.tokenizer import Tokenizer

    template = ("{{ bos_token }}{% for m in messages %}[{{ m.role }}] {% if m.role == 'assistant' %}"
                "{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}{% else %}{{ m.content }}"
                "{% endif %}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")
    folder = _tokenizer_folder(tmp_path, tokenizer_config=json.dumps({"chat_template": template, "eos_token": "</s>"}),
                               special_tokens_map='{"bos_token": {"content": "<s>"}, "eos_token": "<eos>"}')
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}, {"role": "user", "content": "?"}]
    ours = Tokenizer(folder).apply_chat_template(chat)
    theirs, _ = render_jinja_template(conversations=[chat], chat_template=template, add_generation_prompt=True,
                                      bos_token="<s>", eos_token="</s>")
    assert ours == theirs[0] and ours.startswith("<s>[user] hi") and "[assistant] yo</s>" in ours


def test_tokenizer_stop_tokens_from_special_tokens_map_and_unknown_eos(tmp_path):
    """special_tokens_map.json's eos_token stops generation (transformers reads it); an eos_token
    outside the vocabulary is named in a warning, not dropped silently."""
    from dflash_jax.loading.tokenizer import Tokenizer

    folder = _tokenizer_folder(tmp_path, special_tokens_map='{"eos_token": {"content": "<|endoftext|>"}}')
    assert Tokenizer(folder).stop_token_ids == [Tokenizer(folder)._tok.token_to_id("<|endoftext|>")]
    folder = _tokenizer_folder(tmp_path, tokenizer_config='{"eos_token": "<|no such token|>"}',
                               special_tokens_map="{}")
    with pytest.warns(UserWarning, match="eos_token '<|no such token|>' is not in the vocabulary"):
        assert Tokenizer(folder).stop_token_ids == []


def test_chat_template_thinking_switch_and_message_checks(tmp_path):
    from dflash_jax.loading.tokenizer import Tokenizer

    folder = _tokenizer_folder(tmp_path, tokenizer_config=json.dumps({"chat_template": CHAT_TEMPLATE}))
    tokenizer = Tokenizer(folder)
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert tokenizer.apply_chat_template(chat, enable_thinking=False).endswith("assistant\n<think>\n\n</think>\n\n")
    assert tokenizer.apply_chat_template(chat) == tokenizer.apply_chat_template(chat, enable_thinking=True)
    with pytest.raises(ValueError, match="a chat must be a non-empty list"):
        tokenizer.apply_chat_template([])
    plain = _tokenizer_folder(tmp_path, tokenizer_config=json.dumps({"chat_template": "{{ messages }}"}))
    with pytest.raises(ValueError, match="the chat template has no enable_thinking switch"):
        Tokenizer(plain).apply_chat_template("hi", enable_thinking=False)


@pytest.mark.parametrize("name", ["tokenizer_config", "generation_config"])
def test_tokenizer_side_file_that_is_not_json_is_named(tmp_path, name):
    from dflash_jax.loading.tokenizer import Tokenizer

    folder = _tokenizer_folder(tmp_path, **{name: "{oops"})
    with pytest.raises(ValueError, match=f"{name}.json is not valid JSON"):
        Tokenizer(folder)


def test_text_stream_pieces_join_to_the_whole_text():
    from dflash_jax.entrypoints.generate import DEFAULT_MODEL
    from dflash_jax.loading.tokenizer import TextStream, Tokenizer

    tokenizer = Tokenizer(DEFAULT_MODEL / "target")
    ids = tokenizer.encode("x = '日本'")
    assert len(ids) > 6  # the CJK characters are split into byte tokens
    for cut in range(1, len(ids) + 1):  # most cuts end inside a character
        stream = TextStream(tokenizer)
        pieces = [stream.update(ids[:n]) for n in range(1, cut)] + [stream.update(ids[:cut], final=True)]
        assert "".join(pieces) == tokenizer.decode(ids[:cut])


def test_cli_stream_prints_a_cut_character_at_the_end(model_dirs, monkeypatch, capsys):
    """max_new_tokens may end inside a multi-byte character: the last flush still prints the rest."""
    from dflash_jax.entrypoints import generate
    from dflash_jax.loading.tokenizer import Tokenizer

    target_dir, _ = model_dirs
    tokenizer = Tokenizer(target_dir)
    tokens = tokenizer.encode(" = '日本")[:-1]

    monkeypatch.setattr("dflash_jax.runtime.generation.Engine", _canned_engine([tokens[:2], tokens[2:]]))
    assert generate.main(["--target", str(target_dir), "--prompt", "x", "--dtype", "float32",
                          "--impl", "reference"]) == 0
    assert capsys.readouterr().out == "x" + tokenizer.decode(tokens) + "\n"


@pytest.mark.parametrize("args, message", [
    (["--target", "{untemplated}", "--chat"], "has no chat template (neither chat_template.jinja nor a "
                                              "chat_template in tokenizer_config.json); drop --chat"),
    (["--batch-file", "{jsonl}", "--no-draft"], 'prompts.jsonl:2: expected an object with a "prompt" string'),
    (["--batch-file", "{empty}"], "holds no prompts"),
    (["--batch-file", "{blank_jsonl}"], "blank.jsonl:2: the prompt is empty"),
    (["--batch-file", "{tmp}/missing.txt"], "does not exist"),
    (["--page-size", "0"], "--page-size must be >= 1, got 0"),
    (["--chunk-steps", "-1"], "--chunk-steps must be >= 1, got -1"),
    (["--no-draft", "--block-size", "4"], "--block-size needs a draft"),
    (["--stats-json", "{tmp}/missing/stats.json"], "folder does not exist"),
    (["--stats-json", "{tmp}"], "is a folder: give a file name"),
    (["--steps-per-check", "3"], "--steps-per-check (3) must be >= 1 and divide the steps per chunk "
                                 "(--chunk-steps 16)"),
    (["--batch-file", "{upper}", "--no-draft"], 'upper.JSONL:1: expected an object with a "prompt" string'),
    (["--target", "{default}/draft", "--draft", "{default}/target"], "holds a DFlash draft, not a target; "
                                                                      "pass it as the draft (--draft)"),
    (["--draft", "{default}/target"], "holds a Qwen3 target, not a DFlash draft; pass it as the target (--target)"),
    (["--prompt", "x", "--batch-file", "{jsonl}"], "give --prompt or --batch-file, not both"),
    (["--system", "be brief"], "--system needs --chat"),
    (["--no-thinking"], "--no-thinking needs --chat"),
    (["--batch-file", "{chat_jsonl}"], 'holds "messages" chats: add --chat to render them'),
    (["--batch-file", "{bad_chat}"], 'bad_chat.jsonl:1: each chat message must be an object with "role" and '
                                     '"content" strings'),
    (["--max-new-tokens", "1000000"], "more than the target's max_position_embeddings"),
    (["--impl", "pallas"], "attention impl 'pallas' cannot run here"),
    (["--page-size", "8192"], "--page-size 8192 exceeds the target's max_position_embeddings 4096 (prompts are "
                              "padded to whole pages)"),
], ids=["chat", "jsonl", "empty", "blank-jsonl", "missing-file", "page-size", "chunk-steps", "block-size", "stats-json",
        "stats-json-folder", "steps-per-check", "upper-case-jsonl", "swapped", "target-as-draft", "prompt-and-file",
        "system-without-chat", "thinking-without-chat", "messages-without-chat", "bad-messages", "too-long",
        "pallas-on-cpu", "page-larger-than-the-model"])
def test_cli_bad_input_is_one_error_line(tmp_path, capsys, monkeypatch, args, message):
    """Input errors on the embedded default model (or its files without their chat template), before
    any weights load."""
    from dflash_jax.entrypoints import generate

    if jax.default_backend() != "cpu" and "pallas" in args:
        pytest.skip("the kernels run on this GPU")
    monkeypatch.setattr(generate, "load_target", lambda *a, **k: pytest.fail("the weights were loaded"))

    (tmp_path / "prompts.jsonl").write_text('{"prompt": "def a"}\n{"text": "def b"}\n')
    (tmp_path / "empty.txt").write_text("\n \n")
    (tmp_path / "blank.jsonl").write_text('{"prompt": "def a"}\n{"prompt": ""}\n')
    (tmp_path / "upper.JSONL").write_text('{"text": "def a"}\n')
    (tmp_path / "chat.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    (tmp_path / "bad_chat.jsonl").write_text('{"messages": [{"role": "user"}]}\n')
    untemplated = tmp_path / "untemplated"
    untemplated.mkdir()
    for name in ("config.json", "tokenizer.json"):
        (untemplated / name).write_bytes((generate.DEFAULT_MODEL / "target" / name).read_bytes())
    paths = dict(untemplated=untemplated, jsonl=tmp_path / "prompts.jsonl", empty=tmp_path / "empty.txt", tmp=tmp_path,
                 blank_jsonl=tmp_path / "blank.jsonl", upper=tmp_path / "upper.JSONL",
                 chat_jsonl=tmp_path / "chat.jsonl", bad_chat=tmp_path / "bad_chat.jsonl",
                 default=generate.DEFAULT_MODEL)
    assert generate.main([arg.format(**paths) for arg in args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err


def test_cli_stats_json_write_failure_and_interrupt(model_dirs, tmp_path, monkeypatch, capsys):
    """A --stats-json that cannot be written after the run is one error line (the statistics are
    on stderr already); Ctrl-C ends the CLI with status 130 and one line, not a traceback."""
    from dflash_jax.entrypoints import generate

    target_dir, draft_dir = model_dirs
    base = ["--target", str(target_dir), "--draft", str(draft_dir), "--max-new-tokens", "4", "--impl", "reference"]
    real_write = Path.write_text

    def write_text(self, *args, **kwargs):
        if self.name == "stats.json":
            raise OSError("disk full")
        return real_write(self, *args, **kwargs)

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_text", write_text)
    assert generate.main(base + ["--stats-json", str(tmp_path / "stats.json")]) == 1
    assert capsys.readouterr().err.endswith("error: --stats-json: disk full\n")
    monkeypatch.setattr("dflash_jax.runtime.generation.Engine", interrupt)
    with pytest.raises(SystemExit) as stop:
        generate.main(base)
    assert stop.value.code == 130 and capsys.readouterr().err.endswith("interrupted\n")


def test_a_second_run_loads_the_programs_the_first_compiled(model_dirs, tmp_path):
    """generate keeps its compiled programs (jax's persistent cache, by default under
    $XDG_CACHE_HOME/dflash_jax/xla): a second run of the same shapes loads them and prints the same
    answer. $JAX_COMPILATION_CACHE_DIR, when set, is the default instead; ``--compile-cache none``
    keeps nothing."""
    args = ["--target", model_dirs[0], "--no-draft", "--prompt", "def fib", "--max-new-tokens", 6,
            "--impl", "reference"]
    home = tmp_path / "home"
    keep_all = {"JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": 0}  # these tiny programs compile in < 1 s
    first = _cli(*args, XDG_CACHE_HOME=home, **keep_all)
    assert first.returncode == 0, first.stderr
    kept = {path.name.split("-")[0] for path in (home / "dflash_jax" / "xla").iterdir()}
    assert {"jit_prefill_slots", "jit_engine_chunk"} <= kept
    second = _cli(*args, XDG_CACHE_HOME=home, JAX_LOG_COMPILES=1, **keep_all)  # logs each cache hit
    assert second.returncode == 0, second.stderr
    for name in ("jit_prefill_slots", "jit_engine_chunk"):
        assert f"Persistent compilation cache hit for '{name}'" in second.stderr
    assert second.stdout == first.stdout

    jax_own = _cli(*args, XDG_CACHE_HOME=home, JAX_COMPILATION_CACHE_DIR=tmp_path / "jax_own", **keep_all)
    assert jax_own.returncode == 0 and any((tmp_path / "jax_own").iterdir()), jax_own.stderr
    unused = tmp_path / "unused"
    off = _cli(*args, "--compile-cache", "none", XDG_CACHE_HOME=unused, **keep_all)
    assert off.returncode == 0 and off.stdout == first.stdout and not unused.exists(), off.stderr


@pytest.fixture
def jax_cache_settings():
    """No compile cache folder set (CI sets one; a ``generate.main`` run in this process sets one)
    while the test runs, and afterwards the setting as it was."""
    before = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", None)
    yield
    jax.config.update("jax_compilation_cache_dir", before)


def test_a_compile_cache_that_cannot_be_written(model_dirs, tmp_path, monkeypatch, capsys, jax_cache_settings):
    """A folder named by --compile-cache that cannot be written is refused before the weights load;
    the default one (or none, with no home folder) is a warning, and the run goes on compiling as
    it would without."""
    from dflash_jax.entrypoints import cli, generate

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = ["--target", str(model_dirs[0]), "--no-draft", "--prompt", "x", "--max-new-tokens", "2",
            "--impl", "reference"]
    assert generate.main(args + ["--compile-cache", str(blocker / "xla")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --compile-cache {blocker / 'xla'}: cannot write {blocker / 'xla'}")
    assert err.count("\n") == 1

    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    with pytest.warns(UserWarning, match="compiled programs are not kept between runs: cannot write"):
        assert cli.keep_compiled_programs(None) is None
    assert jax.config.jax_compilation_cache_dir is None

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setattr(Path, "home", no_home)  # no $HOME and no password entry
    with pytest.warns(UserWarning, match="not kept between runs: no home folder to keep them in"):
        assert cli.keep_compiled_programs(None) is None
    assert cli.keep_compiled_programs(str(tmp_path / "ok")) == tmp_path / "ok"
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "ok")


def test_compile_cache_folder_defaults(tmp_path, monkeypatch, jax_cache_settings):
    """``--compile-cache`` absent: jax's own setting, else $XDG_CACHE_HOME/dflash_jax/xla, else
    ~/.cache/dflash_jax/xla; "none" is no folder; ~ is expanded."""
    from dflash_jax.entrypoints.cli import compile_cache_folder

    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax_own"))
    assert compile_cache_folder(None) == tmp_path / "jax_own"
    jax.config.update("jax_compilation_cache_dir", None)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert compile_cache_folder(None) == tmp_path / "xdg" / "dflash_jax" / "xla"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert compile_cache_folder(None) == tmp_path / "home" / ".cache" / "dflash_jax" / "xla"
    assert compile_cache_folder("~/xla") == tmp_path / "home" / "xla"
    assert compile_cache_folder("none") is None


def test_cli_exits_quietly_when_its_reader_leaves_and_cleanly_when_interrupted(model_dirs):
    """``generate | head -c 20``: status 141 and no traceback. Ctrl-C while the answer streams:
    status 130 and the one "interrupted" line; the exit does not tear the interpreter down under
    the chunk still in flight, which used to end some runs in a segfault (``cli.exit_with``)."""
    import signal

    target_dir, draft_dir = model_dirs
    command = [sys.executable, "-m", "dflash_jax.generate", "--target", target_dir, "--draft", draft_dir,
               "--prompt", "def fib", "--max-new-tokens", "3000", "--chunk-steps", "2", "--impl", "reference"]
    env = _cli_env()
    for leave in ("close", "interrupt"):
        # SIGINT as a terminal's Ctrl-C finds it (a shell script's background job inherits it ignored)
        run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        assert len(run.stdout.read(20)) == 20  # the answer is streaming
        if leave == "close":
            run.stdout.close()
        else:
            run.send_signal(signal.SIGINT)
        err = run.stderr.read().decode()
        assert run.wait(timeout=900) == (141 if leave == "close" else 130), err
        assert "Traceback" not in err and (leave == "close" or err.endswith("interrupted\n")), err
        if leave == "interrupt":
            run.stdout.close()


def test_batch_file_may_be_a_pipe(tmp_path):
    """``--batch-file /dev/stdin`` or a shell's ``<(...)`` name a pipe, not a regular file: it is
    read as lines of text (it used to be refused as a file that "does not exist")."""
    import os
    import threading

    from dflash_jax.loading.tokenizer import read_prompt_file

    pipe = tmp_path / "prompts"
    os.mkfifo(pipe)
    # a daemon: were the pipe refused, the writer would wait for a reader for ever
    writer = threading.Thread(target=pipe.write_text, args=("def g():\n\nclass A:\n",), daemon=True)
    writer.start()
    with pytest.warns(UserWarning, match=r"blank line\(s\) 2 skipped"):
        assert read_prompt_file(pipe, "--batch-file") == {1: "def g():", 3: "class A:"}
    writer.join()


def test_batch_file_lines_end_at_newlines_only(tmp_path):
    """Form feeds, U+2028 and \\r\\n endings stay inside their prompt (str.splitlines would split)."""
    import argparse

    from dflash_jax.entrypoints.generate import _read_prompts

    text = tmp_path / "prompts.txt"
    text.write_bytes("x = 1  # page\x0cy = 2\r\nsecond\u2028line\n\nthird\n".encode())
    with pytest.warns(UserWarning, match=r"blank line\(s\) 3 skipped"):
        assert _read_prompts(argparse.Namespace(batch_file=str(text), prompt=None)) == {
            f"{text}:1": "x = 1  # page\x0cy = 2", f"{text}:2": "second\u2028line", f"{text}:4": "third"}
    records = tmp_path / "prompts.jsonl"
    records.write_text(json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False) + "\n", encoding="utf-8")
    assert _read_prompts(argparse.Namespace(batch_file=str(records), prompt=None)) == {f"{records}:1": "a\u2028b"}


def test_batch_file_byte_order_mark_json_encoding_and_folder(tmp_path):
    import argparse

    from dflash_jax.entrypoints.generate import _read_prompts

    def read(path):
        return list(_read_prompts(argparse.Namespace(batch_file=str(path), prompt=None)).values())

    (tmp_path / "bom.txt").write_bytes("\ufeffHello\nWorld\n".encode())
    assert read(tmp_path / "bom.txt") == ["Hello", "World"]
    (tmp_path / "bom.jsonl").write_bytes('\ufeff{"prompt": "a"}\n'.encode())
    assert read(tmp_path / "bom.jsonl") == ["a"]
    (tmp_path / "prompts.json").write_text('[{"prompt": "a"}]')
    with pytest.raises(ValueError, match=r"a \.json file is not read as JSON"):
        read(tmp_path / "prompts.json")
    (tmp_path / "latin.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    with pytest.raises(ValueError, match="latin.txt is not UTF-8 text"):
        read(tmp_path / "latin.txt")
    with pytest.raises(IsADirectoryError, match="is a folder"):
        read(tmp_path)


def test_chat_template_runs_sandboxed_with_transformers_globals(tmp_path):
    """A model folder's template cannot run code; tools/documents are None, tojson does not
    escape HTML, strftime_now exists (as in transformers); a broken template only stops --chat."""
    from dflash_jax.loading.tokenizer import Tokenizer

    marker = tmp_path / "PWNED"
    evil = "{{ cycler.__init__.__globals__.os.system('touch " + str(marker) + "') }}"
    folder = _tokenizer_folder(tmp_path, tokenizer_config=json.dumps({"chat_template": evil}))
    with pytest.raises(ValueError, match="chat template failed"):
        Tokenizer(folder).apply_chat_template("hi")
    assert not marker.exists()
    template = ("{% if tools is not none or documents is not none %}TOOLS{% endif %}{{ messages | tojson }}"
                "{{ strftime_now('%Y') | length }}")
    folder = _tokenizer_folder(tmp_path, tokenizer_config=json.dumps({"chat_template": template}))
    assert Tokenizer(folder).apply_chat_template("<a & ü>") == '[{"role": "user", "content": "<a & ü>"}]4'
    broken = {"chat_template": [{"name": "tool_use", "template": "x"}], "eos_token": "<|endoftext|>"}
    tokenizer = Tokenizer(_tokenizer_folder(tmp_path, tokenizer_config=json.dumps(broken)))
    assert tokenizer.stop_token_ids and tokenizer.encode("x")
    with pytest.raises(ValueError, match="one named 'default'"):
        tokenizer.apply_chat_template("hi")


def test_text_stream_across_lines_joins_to_the_whole_text():
    from dflash_jax.entrypoints.generate import DEFAULT_MODEL
    from dflash_jax.loading.tokenizer import TextStream, Tokenizer

    tokenizer = Tokenizer(DEFAULT_MODEL / "target")
    ids = tokenizer.encode("def f():\n    return '日本'\n\n\nx = f()  # é\n")
    for step in (1, 2, 3, 5):
        stream = TextStream(tokenizer)
        cuts = list(range(step, len(ids), step)) + [len(ids)]
        pieces = [stream.update(ids[:n], final=n == len(ids)) for n in cuts]
        assert "".join(pieces) == tokenizer.decode(ids)
        assert "\ufffd" not in "".join(pieces[:-1])


def test_library_argument_names_become_flags_as_whole_names_only():
    """named_as_flags turns top_p into --top-p in a refusal, but leaves another name that ends in
    it (min_top_p) alone, re-raising the error unchanged."""
    from dflash_jax.entrypoints.cli import named_as_flags

    with pytest.raises(ValueError, match=r"^--top-p must be in \(0, 1\]$"):
        with named_as_flags(["top_p"]):
            raise ValueError("top_p must be in (0, 1]")
    error = ValueError("min_top_p bad")
    with pytest.raises(ValueError) as info:
        with named_as_flags(["top_p"]):
            raise error
    assert info.value is error and str(error) == "min_top_p bad"


def test_cli_warnings_print_as_one_line():
    import warnings

    from dflash_jax.entrypoints.cli import one_line_warnings

    before = warnings.formatwarning
    with one_line_warnings():
        assert warnings.formatwarning("made for 36 layers", UserWarning, "x.py", 3) == "warning: made for 36 layers\n"
        assert warnings.formatwarning("old", DeprecationWarning, "x.py", 3) == "DeprecationWarning: old\n"
    assert warnings.formatwarning is before


def test_cli_warns_of_what_it_ignores(model_dirs, tmp_path, monkeypatch, capsys):
    """--baseline with no draft, --top-p/--top-k when greedy and stop ids outside the vocabulary
    each print one warning before the weights load (stopped there here)."""
    import shutil
    import warnings

    from dflash_jax.entrypoints import generate

    def stop(*args, **kwargs):
        raise ValueError("stopped before the weights")

    monkeypatch.setattr(generate, "load_target", stop)
    target = tmp_path / "target"
    shutil.copytree(model_dirs[0], target)
    (target / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 99999]}))
    with pytest.warns(UserWarning) as record:
        # --impl reference: this tiny model's head_dim (8) is too small for the GPU kernels auto picks there
        assert generate.main(["--target", str(target), "--no-draft", "--baseline", "--top-k", "5",
                              "--impl", "reference"]) == 2
    assert [str(w.message) for w in record] == [
        "--baseline compares DFlash with plain decoding; with no draft there is nothing to compare",
        "--top-p and --top-k shape sampling; at --temperature 0 decoding is greedy and ignores them",
        f"{target}: stop token id(s) [99999] lie outside the vocabulary "
        f"({generate.load_target_config(target).vocab_size} tokens) and can never stop a sequence"]
    assert capsys.readouterr().err == "error: stopped before the weights\n"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # sampling with the stop ids of the model: nothing to warn of
        assert generate.main(["--target", str(model_dirs[0]), "--no-draft", "--temperature", "0.5",
                              "--top-p", "0.9", "--impl", "reference"]) == 2


def test_cli_draft_without_target_names_the_embedded_target(model_dirs, capsys):
    from dflash_jax.entrypoints import generate

    assert generate.main(["--draft", str(model_dirs[1])]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "no --target was given, so the target is the embedded default" in err


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_cli_help_describes_every_flag_and_its_default(monkeypatch, command):
    """Each flag of --help has a description; each that takes a value names its default, as a value
    or as what leaving the flag out means (never a bare None): --target lists every family, --dtype
    says that a CPU runs float32."""
    from dflash_jax.entrypoints import arguments
    from dflash_jax.model.families import FAMILIES

    monkeypatch.setenv("COLUMNS", "100")
    parser = getattr(arguments, f"{command}_parser")()
    text = parser.format_help()
    described, flag = {}, None  # flag -> its help text, from the lines that describe it
    for line in text.splitlines():
        if line.startswith("  -"):
            invocation, _, description = line.strip().partition("  ")
            flag = invocation.split()[0].rstrip(",")
            described[flag] = description.strip()
        elif line.startswith("    ") and flag:
            described[flag] += " " + line.strip()
        else:
            flag = None
    assert "default: None" not in text
    options = [action for action in parser._actions if action.option_strings and action.dest != "help"]
    assert len(options) > 20 and sorted(described) == sorted(["-h"] + [a.option_strings[0] for a in options])
    for action in options:
        help_text = described[action.option_strings[0]]
        assert help_text, action.option_strings
        if action.default is not None and action.default is not False:
            assert f"(default: {action.default})" in help_text, help_text
        elif action.nargs != 0:  # takes a value: says what its absence means
            assert "default: " in help_text, help_text
    families = {family.label.split(" (")[0] for family in FAMILIES}
    assert len(families) == 7 and all(label in described["--target"] for label in families)
    assert "default: float32 on CPU, bfloat16 on GPU/TPU" in described["--dtype"]


def test_help_and_usage_errors_answer_without_jax():
    """``python -m dflash_jax.generate --help`` and ``python -m dflash_jax.serve --help`` (and their
    usage errors) parse the arguments before jax is imported: they answer in a fraction of a
    second, not the seconds jax takes to import."""
    check = ("import runpy, sys\n"
             "for module, args in [('dflash_jax.generate', ['--help']), ('dflash_jax.serve', ['--help']),\n"
             "                     ('dflash_jax.generate', ['--max-num-seqs', '0'])]:\n"
             "    sys.argv = [module, *args]\n"
             "    try:\n"
             "        runpy.run_module(module, run_name='__main__', alter_sys=True)\n"
             "    except SystemExit as stop:\n"
             "        print(module, args[0], stop.code, file=sys.stderr)\n"
             "print(sorted(name for name in sys.modules if name.split('.')[0] in ('jax', 'jaxlib', 'numpy')))\n"
             "from dflash_jax.generate import generate\n"  # the library's names still import from it
             "print(generate.__module__)\n")
    run = subprocess.run([sys.executable, "-c", check], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env=_cli_env())
    assert run.returncode == 0 and run.stdout.splitlines()[-2:] == ["[]", "dflash_jax.runtime.generation"], \
        run.stderr
    assert "usage: python -m dflash_jax.serve" in run.stdout and "--no-baseline" in run.stdout
    assert "dflash_jax.generate --help 0" in run.stderr and "dflash_jax.serve --help 0" in run.stderr
    assert "--max-num-seqs: must be an integer >= 1, got '0'" in run.stderr


def test_argument_copies_equal_what_they_copy():
    """``arguments`` (which must not import jax) copies a few values of heavier modules: the dtypes,
    the MXFP4 choices, the kernel choices, the target families of the registry."""
    from dflash_jax.entrypoints import arguments
    from dflash_jax.loading import models
    from dflash_jax.model import ops
    from dflash_jax.model.families import FAMILIES

    assert sorted(arguments.DTYPE_NAMES) == sorted(models.DTYPES)
    assert arguments.MXFP4_CHOICES == models.MXFP4_EXPERTS
    assert arguments.IMPLS == ops.IMPLS
    assert arguments.target_families() == list(dict.fromkeys(f.label.split(" (")[0] for f in FAMILIES))


def _canned_engine(pieces: list[list[int]]):
    """An Engine class that answers every request with these pieces of tokens, through the real
    engine's text handling, without running the models (nothing compiles beyond its empty cache)."""
    from dflash_jax.runtime.engine import Engine

    class Canned(Engine):
        def step(self):
            with self._lock:
                waiting = list(self.scheduler.waiting)
                self.scheduler.waiting.clear()
            for request in waiting:
                request.first_token_time = time.monotonic()
                for index, piece in enumerate(pieces):
                    self.output.emit(request, piece, [], "length" if index == len(pieces) - 1 else None)
            return bool(waiting)

    return Canned


@pytest.fixture
def canned_answer(model_dirs, monkeypatch):
    """generate.main on the tiny target, every prompt answered " = 1" without compiling: returns
    (run: argv -> exit status, the answer's text)."""
    from dflash_jax.entrypoints import generate
    from dflash_jax.loading.tokenizer import Tokenizer

    tokens = Tokenizer(model_dirs[0]).encode(" = 1")
    monkeypatch.setattr("dflash_jax.runtime.generation.Engine", _canned_engine([tokens]))
    return (lambda *args: generate.main(["--target", str(model_dirs[0]), "--no-draft", *map(str, args)]),
            Tokenizer(model_dirs[0]).decode(tokens))


def test_cli_prints_the_prompt_as_given_or_only_the_completion(canned_answer, tmp_path, capsys):
    """The prompt printed before an answer is the user's, never the rendered chat template (under
    --chat the answer starts a line of its own); --completion-only prints the answers alone."""
    run, answer = canned_answer
    assert run("--prompt", "def a", "--dtype", "float32") == 0
    assert capsys.readouterr().out == f"def a{answer}\n"
    assert run("--prompt", "def a", "--chat", "--dtype", "float32") == 0
    assert capsys.readouterr().out == f"def a\n{answer}\n"
    assert run("--prompt", "def a", "--chat", "--completion-only", "--dtype", "float32") == 0
    assert capsys.readouterr().out == f"{answer}\n"
    prompts = tmp_path / "prompts.jsonl"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"},
             {"role": "user", "content": "x"}]
    prompts.write_text(json.dumps({"prompt": "def a"}) + "\n" + json.dumps({"messages": turns}) + "\n")
    assert run("--batch-file", prompts, "--chat", "--dtype", "float32") == 0
    assert capsys.readouterr().out == (f'=== {prompts}:1 "def a"\n{answer}\n\n'
                                       f"=== {prompts}:2 {json.dumps(turns)}\n{answer}\n\n")
    assert run("--batch-file", prompts, "--chat", "--completion-only", "--dtype", "float32") == 0
    assert capsys.readouterr().out == f"{answer}\n\n" * 2


def test_cli_batch_file_blank_lines_keep_the_line_numbers(canned_answer, tmp_path, capsys):
    """Blank lines of a text batch file are skipped with a warning naming them; the output and the
    errors cite each prompt by its line in the file."""
    run, answer = canned_answer
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def a\n\n  \nclass B\n")
    with pytest.warns(UserWarning, match=rf"--batch-file {prompts}: blank line\(s\) 2, 3 skipped"):
        assert run("--batch-file", prompts, "--dtype", "float32") == 0
    assert capsys.readouterr().out == (f'=== {prompts}:1 "def a"\n{answer}\n\n'
                                       f'=== {prompts}:4 "class B"\n{answer}\n\n')
    prompts.write_text("\ndef a\n")  # one prompt: streamed as --prompt is
    with pytest.warns(UserWarning, match=r"blank line\(s\) 1 skipped"):
        assert run("--batch-file", prompts, "--max-new-tokens", 10**6) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {prompts}:2 has ") and "more than the target's max_position_embeddings" in err


def test_cli_runs_float32_on_a_cpu_unless_told(canned_answer, capsys):
    """Without --dtype a CPU runs float32 (bfloat16 runs 2-3x slower there); a bfloat16 asked for
    on a CPU gets a hint that says so."""
    from dflash_jax.entrypoints.cli import default_dtype

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU default")
    assert default_dtype() == "float32"
    run, _ = canned_answer
    assert run("--prompt", "x") == 0
    err = capsys.readouterr().err
    assert ", float32, jax " in err and "hint:" not in err
    assert run("--prompt", "x", "--dtype", "bfloat16") == 0
    err = capsys.readouterr().err
    assert ", bfloat16, jax " in err
    assert "hint: on a CPU, bfloat16 runs 2-3x slower than float32 (the CPU default: leave out --dtype)\n" in err


def test_the_demo_compares_with_plain_decoding_unless_told_not_to(monkeypatch, capsys):
    """Without --target the embedded pair runs, then plain decoding for comparison; --no-baseline
    leaves the comparison out."""
    from dflash_jax.entrypoints import generate

    monkeypatch.setattr("dflash_jax.runtime.generation.Engine", _canned_engine([[5, 6]]))
    assert generate.main(["--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert "[dflash]" in err and "[plain]" in err and "[compare]" in err
    assert generate.main(["--max-new-tokens", "2", "--no-baseline"]) == 0
    err = capsys.readouterr().err
    assert "[dflash]" in err and "[plain]" not in err and "[compare]" not in err


def test_cli_batch_of_mixed_lengths_streams_answers_as_they_finish(model_dirs, tmp_path, capsys):
    """64 prompts of 1 to ~300 tokens through --max-num-seqs 4 slots (continuous batching: the
    KV pool holds 4 requests, not 64 padded to the longest): every answer equals that prompt run
    alone, --output-jsonl gets one object per prompt, the progress bar counts them."""
    from dflash_jax.entrypoints import generate
    from dflash_jax.loading.models import load_target
    from dflash_jax.loading.tokenizer import Tokenizer

    target_dir, draft_dir = model_dirs
    tokenizer = Tokenizer(target_dir)
    rng = np.random.default_rng(0)
    words = ["def", "fibonacci", "(n):", "return", "n", "if", "<", "2", "else", "-", "1"]
    lines = [" ".join(rng.choice(words, size=int(rng.integers(1, 120)))) for _ in range(64)]
    batch, out = tmp_path / "prompts.txt", tmp_path / "out.jsonl"
    batch.write_text("\n".join(lines) + "\n")
    assert generate.main(["--target", str(target_dir), "--draft", str(draft_dir), "--batch-file", str(batch),
                          "--max-num-seqs", "4", "--max-new-tokens", "6", "--output-jsonl", str(out),
                          "--dtype", "float32", "--impl", "reference"]) == 0
    captured = capsys.readouterr()
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["index"] for r in records) == list(range(64))
    assert "64/64" in captured.err and "tok/s" in captured.err
    target = load_target(target_dir, "float32")
    for record in records[:5] + records[-3:]:
        ids = tokenizer.encode(lines[record["index"]])
        alone = generate.generate(target, [ids], max_new_tokens=6, stop_token_ids=tokenizer.stop_token_ids,
                                  impl="reference").tokens[0]
        assert record["token_ids"] == alone and record["text"] == tokenizer.decode(alone)
        assert record["prompt"] == lines[record["index"]] and record["prompt_name"] == f"{batch}:{record['index'] + 1}"
        assert record["finish_reason"] in ("stop", "length") and record["tau"] > 0
        assert f"=== {batch}:{record['index'] + 1} " in captured.out


def test_cli_reads_prompts_from_stdin_and_writes_jsonl_to_stdout(model_dirs):
    run = subprocess.run([sys.executable, "-m", "dflash_jax.generate", "--target", str(model_dirs[0]), "--no-draft",
                          "--batch-file", "-", "--output-jsonl", "-", "--max-new-tokens", "3", "--dtype", "float32",
                          "--impl", "reference"], cwd=ROOT, capture_output=True, text=True, timeout=900,
                         env=_cli_env(), input="def fib\n\nreturn n\n")
    assert run.returncode == 0, run.stderr
    records = [json.loads(line) for line in run.stdout.splitlines()]
    assert sorted((r["index"], r["prompt_name"], r["prompt"]) for r in records) == [
        (0, "/dev/stdin:1", "def fib"), (1, "/dev/stdin:3", "return n")]
    assert "--batch-file /dev/stdin: blank line(s) 2 skipped" in run.stderr  # one name for standard input


def test_cli_one_prompt_with_jsonl_to_stdout_prints_only_the_json(model_dirs, capsys):
    from dflash_jax.entrypoints import generate

    assert generate.main(["--target", str(model_dirs[0]), "--no-draft", "--prompt", "def fib", "--output-jsonl", "-",
                          "--max-new-tokens", "3", "--dtype", "float32", "--impl", "reference"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["prompt"] == "def fib"
