"""The serving engine (dflash_jax.runtime.engine): continuous batching gives every request what it
would get alone, greedy rows token for token; admission, chunked prefill, slot reuse and page
freeing under random arrivals; per-request sampling exact in distribution; streamed text the
tokenizer's decode of the tokens; prefix caching reuses a cached prefix's pages with the same
tokens and acceptance, and under random arrivals on a small pool loses no page."""

import dataclasses
import itertools
import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax.runtime.generation import generate
from dflash_jax.loading.tokenizer import Tokenizer
from dflash_jax.model.nn.gated_deltanet import GatedDeltaNetSpec
from dflash_jax.runtime.engine import Engine, QueueFullError, RequestParams
from dflash_jax.runtime.engine.prefix_cache import prefix_caching_unsupported
from dflash_jax.runtime.sampling import SamplingConfig


def _prompts(count: int, seed: int, vocab: int = 120, longest: int = 40) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(1, vocab, size=int(rng.integers(1, longest))).tolist() for _ in range(count)]


def _run(engine: Engine, prompts, params) -> list:
    """Submit every prompt (params one or per prompt), step to the end; each request's outputs."""
    params = params if isinstance(params, list) else [params] * len(prompts)
    outputs = [[] for _ in prompts]
    requests = [engine.submit(p, q, on_output=outputs[i].append) for i, (p, q) in enumerate(zip(prompts, params))]
    engine.run_until_done()
    assert all(r.finished for r in requests)
    return requests, outputs


def _random_arrivals(engine: Engine, prompts, rng: random.Random, after_step=lambda: None) -> tuple[dict, dict]:
    """Submit the prompts one by one at random steps (random max_tokens up to 20), cancel a random
    running request now and then, step until done (``after_step`` after each step); the requests
    and their last outputs, by prompt index."""
    pending = list(enumerate(prompts))
    submitted, finals = {}, {}
    while pending or engine.has_work():
        if pending and rng.random() < 0.5:
            index, prompt = pending.pop(0)
            submitted[index] = engine.submit(prompt, RequestParams(max_tokens=rng.randint(1, 20)),
                                             on_output=lambda o, i=index: o.finished and finals.setdefault(i, o))
        live = [r for r in submitted.values() if not r.finished]
        if live and rng.random() < 0.1:
            engine.cancel(rng.choice(live))
        engine.step()
        after_step()
    return submitted, finals


ALONE_TOKENS = 48   # the most any test's request here asks for, or more
_ALONE: dict[tuple[int, int], tuple] = {}   # (target, draft) ids -> (target, draft, engine)


def _alone(target, prompt, max_tokens: int, draft=None) -> list[int]:
    """Greedy tokens of ``prompt`` decoded alone (offline, one slot): the first ``max_tokens`` of
    ``ALONE_TOKENS``, from one engine kept per model pair, so that every call runs the same
    compiled programs (greedy tokens depend neither on how many follow nor on the engine's
    sizes)."""
    assert max_tokens <= ALONE_TOKENS
    key = (id(target), id(draft))
    if key not in _ALONE:   # the models are kept beside their engine: their ids stay theirs
        _ALONE[key] = target, draft, Engine(target, draft, max_num_seqs=1, max_model_len=128, impl="reference",
                                            prefix_caching=False)
    engine = _ALONE[key][2]
    request = engine.submit(prompt, RequestParams(max_tokens=ALONE_TOKENS))
    engine.run_until_done()
    return request.token_ids[:max_tokens]


def _check_idle(engine: Engine) -> None:
    """Nothing leaked: no page referenced, nothing promised, every page free or cached, every slot
    free."""
    scheduler = engine.scheduler
    assert engine.pages_in_use == 0 and scheduler.reserved == 0
    assert len(scheduler.free_pages) + engine.cached_pages == engine.num_pages
    assert engine.num_running == 0 and engine.num_waiting == 0
    scheduler.check_invariants()


@pytest.mark.parametrize("with_draft", [True, False], ids=["dflash", "plain"])
def test_greedy_equals_offline_generation(spec_pair, with_draft):
    """More requests than slots, prompts longer than a prefill chunk, ragged max_tokens, a pool
    smaller than every slot at full length: every request's tokens equal its tokens decoded
    alone (``_alone``), and the streamed pieces join to the whole."""
    draft = spec_pair.draft if with_draft else None
    prompts = _prompts(7, seed=3)
    max_tokens = [5, 17, 33, 1, 24, 9, 40]
    engine = Engine(spec_pair.target, draft, max_num_seqs=3, max_model_len=96, page_size=8, prefill_chunk=16,
                    chunk_steps=4, num_pages=40, impl="reference")
    requests, outputs = _run(engine, prompts, [RequestParams(max_tokens=m) for m in max_tokens])
    for prompt, m, request, pieces in zip(prompts, max_tokens, requests, outputs):
        alone = _alone(spec_pair.target, prompt, m, draft)
        assert request.token_ids == alone
        assert sum((o.token_ids for o in pieces), []) == alone
        assert pieces[-1].finished and pieces[-1].finish_reason == "length"
        if with_draft:
            assert sum(request.accept_lengths) + 1 == len(alone)
    _check_idle(engine)
    assert engine.stats.generation_tokens == sum(max_tokens)
    if with_draft:
        assert engine.stats.num_accepted_tokens > 0


def test_random_arrivals_lose_nothing(spec_pair):
    """Requests arriving between steps at random, some cancelled while waiting, prefilling or
    decoding: each finished one equals its output alone, every cancelled one ends with "abort",
    and every page comes back."""
    rng = random.Random(7)
    engine = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=2, max_model_len=80, page_size=8,
                    prefill_chunk=8, chunk_steps=2, num_pages=24, impl="reference")
    prompts = _prompts(8, seed=11, longest=30)
    submitted, finals = _random_arrivals(engine, prompts, rng)
    assert sorted(finals) == list(range(len(prompts)))
    for index, request in submitted.items():
        if request.cancelled:
            continue
        assert finals[index].finish_reason == "length"
        alone = _alone(spec_pair.target, prompts[index], request.params.max_tokens, spec_pair.draft)
        assert request.token_ids == alone
    assert any(r.cancelled for r in submitted.values())
    assert all(finals[i].finish_reason == "abort" for i, r in submitted.items() if r.cancelled)
    _check_idle(engine)


def test_admission_refuses_what_can_never_fit_and_queues_the_rest(spec_pair):
    engine = Engine(spec_pair.target, max_num_seqs=2, max_model_len=64, page_size=8, num_pages=6,
                    max_waiting=2, impl="reference")
    with pytest.raises(ValueError, match="needs 7 pages of 8 tokens, more than the engine's 6"):
        engine.submit([1] * 30, RequestParams(max_tokens=20))
    with pytest.raises(ValueError, match="more than the maximum context length 64"):
        engine.submit([1] * 60, RequestParams(max_tokens=5))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.submit([1, 100000], RequestParams())
    with pytest.raises(ValueError, match="the prompt is empty"):
        engine.submit([], RequestParams())
    first = engine.submit([1, 2, 3], RequestParams(max_tokens=30))   # 5 pages promised
    second = engine.submit([4, 5, 6], RequestParams(max_tokens=30))  # waits: 5 more do not fit beside
    with pytest.raises(QueueFullError, match="queue is full"):
        engine.submit([7], RequestParams(max_tokens=1))
    engine.step()
    assert first.slot is not None and second.slot is None and engine.num_waiting == 1
    engine.run_until_done()
    assert first.finished and second.finished
    _check_idle(engine)


def test_stop_strings_and_tokens(spec_pair):
    """A stop token ends a request with "stop" (the token kept); ignore_eos runs past the model's
    end-of-sequence ids."""
    prompt = _prompts(1, seed=5)[0]
    alone = generate(spec_pair.target, [prompt], max_new_tokens=20, impl="reference").tokens[0]
    stop = alone[6]
    engine = Engine(spec_pair.target, max_num_seqs=2, max_model_len=96, page_size=8, impl="reference",
                    stop_token_ids=[alone[3]])
    requests, outputs = _run(engine, [prompt, prompt], [
        RequestParams(max_tokens=20, stop_token_ids=(stop,)), RequestParams(max_tokens=20, ignore_eos=True)])
    cut = alone.index(alone[3]) if alone.index(alone[3]) < alone.index(stop) else alone.index(stop)
    assert requests[0].token_ids == alone[:cut + 1] and outputs[0][-1].finish_reason == "stop"
    assert requests[1].token_ids == alone and outputs[1][-1].finish_reason == "length"


def _sentencepiece_tokenizer(folder) -> Tokenizer:
    """A tokenizer of the test target's 128 ids in Llama 2's and Mistral's form: SentencePiece BPE
    ("▁" a word-start space, dropped at the start of a decode) with some <0xXX> byte tokens (日
    is three of them); many tokens end in a newline, many start a word with "+"."""
    from tokenizers import AddedToken, decoders, models, normalizers
    from tokenizers import Tokenizer as HFTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + i for i, b in enumerate(b"\xe6\x97\xa5\x0a\xff")}
    letters = "abcdefghijklmnopqrstuvwxyz"
    for piece in ["▁", "\n", "é", *(p for c in letters for p in (f"{c}\n", f"▁+{c}", f"▁{c}", c)),
                  *(f"▁{c}{d}" for c, d in itertools.product(letters, repeat=2))]:
        if len(vocab) < 128:
            vocab[piece] = len(vocab)
    tokenizer = HFTokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                           decoders.Strip(" ", 1, 0)])
    tokenizer.add_special_tokens([AddedToken(t, special=True) for t in ("<unk>", "<s>", "</s>")])
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return Tokenizer(folder)


def test_streamed_text_is_the_decode_of_the_tokens(spec_pair, tmp_path):
    """With a SentencePiece tokenizer, word-start tokens after newlines and characters of byte
    tokens arriving several a step (DFlash): a request's pieces of text join to the tokenizer's
    decode of its tokens; with the stop string "\\n +" (matched on that text) the text ends before
    it and the tokens with the one that completes it."""
    tokenizer = _sentencepiece_tokenizer(tmp_path / "tokenizer")
    prompts = _prompts(6, seed=5, vocab=128, longest=20)
    stop = "\n +"
    engine = Engine(spec_pair.target, spec_pair.draft, tokenizer, max_num_seqs=4, max_model_len=96, page_size=8,
                    chunk_steps=2, impl="reference")
    params = [RequestParams(max_tokens=30), RequestParams(max_tokens=30, stop=(stop,))]
    requests, outputs = _run(engine, [p for p in prompts for _ in params], params * len(prompts))
    stopped = 0
    for plain, cut, plain_pieces, cut_pieces in zip(requests[::2], requests[1::2], outputs[::2], outputs[1::2]):
        whole = tokenizer.decode(plain.token_ids)
        assert "".join(o.text for o in plain_pieces) == whole and plain_pieces[-1].finish_reason == "length"
        assert plain.token_ids[:len(cut.token_ids)] == cut.token_ids
        text = "".join(o.text for o in cut_pieces)
        if stop in whole:
            stopped += 1
            assert text == whole[:whole.index(stop)] and cut_pieces[-1].finish_reason == "stop"
            assert stop in tokenizer.decode(cut.token_ids) and stop not in tokenizer.decode(cut.token_ids[:-1])
        else:
            assert text == whole and cut.token_ids == plain.token_ids
    assert stopped >= 2 and max(len(o.token_ids) for pieces in outputs for o in pieces) > 1
    _check_idle(engine)


def test_mixed_sampling_rows_keep_greedy_rows_exact(spec_pair):
    """Greedy and sampled requests in one batch (different temperatures, top-k, top-p, min-p):
    the greedy ones equal their outputs alone; a seeded sampled request gives the same tokens
    whatever runs beside it."""
    prompts = _prompts(4, seed=21)
    settings = [SamplingConfig(), SamplingConfig(temperature=0.8, top_k=5), SamplingConfig(),
                SamplingConfig(temperature=1.1, top_p=0.9, min_p=0.05)]
    params = [RequestParams(max_tokens=12, sampling=s, seed=100 + i) for i, s in enumerate(settings)]
    engine = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=4, max_model_len=96, page_size=8,
                    impl="reference")
    requests, _ = _run(engine, prompts, params)
    for prompt, request, setting in zip(prompts, requests, settings):
        if setting.greedy:
            alone = _alone(spec_pair.target, prompt, 12, spec_pair.draft)
            assert request.token_ids == alone
    lone = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=4, max_model_len=96, page_size=8, impl="reference")
    again, _ = _run(lone, [prompts[1]], [params[1]])
    assert again[0].token_ids == requests[1].token_ids


@pytest.mark.parametrize("with_draft", [True, False], ids=["dflash", "plain"])
def test_logprobs_are_the_target_log_softmax(spec_pair, with_draft):
    """Each emitted token's log-probability and the top ones equal transformers' log-softmax of
    the whole sequence at that position, greedy and sampled, DFlash or not; a request that does
    not ask gets none beside one that does."""
    import torch

    prompts = _prompts(3, seed=31)
    params = [RequestParams(max_tokens=10, logprobs=3),
              RequestParams(max_tokens=12, logprobs=0, sampling=SamplingConfig(temperature=1.0), seed=5),
              RequestParams(max_tokens=6)]
    engine = Engine(spec_pair.target, spec_pair.draft if with_draft else None, max_num_seqs=3, max_model_len=96,
                    page_size=8, chunk_steps=2, impl="reference")
    requests, outputs = _run(engine, prompts, params)
    for prompt, request, pieces in zip(prompts, requests, outputs):
        if request.params.logprobs is None:
            assert all(o.logprobs is None for o in pieces) and request.logprobs == []
            continue
        assert [lp.token_id for o in pieces for lp in o.logprobs] == request.token_ids
        with torch.no_grad():
            logits = spec_pair.hf_target(torch.tensor([prompt + request.token_ids])).logits[0].float()
        expected = torch.log_softmax(logits, -1)[len(prompt) - 1:-1]
        for position, (token, lp) in enumerate(zip(request.token_ids, request.logprobs)):
            assert abs(lp.logprob - expected[position, token].item()) < 1e-4
            top = torch.topk(expected[position], request.params.logprobs)
            assert [i for i, _ in lp.top] == top.indices.tolist()
            np.testing.assert_allclose([v for _, v in lp.top], top.values.numpy(), atol=1e-4)
    _check_idle(engine)


ENGINE_PROGRAMS = ("prefill_slots", "engine_chunk", "admit_slots", "set_page_rows", "release_slots")


def test_warmup_compiles_what_requests_run(spec_pair, compilations):
    """After warmup, requests of any prompt length up to the prefill chunk (greedy) compile
    nothing more; the first token arrives with the prefill, before any decode chunk."""
    engine = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=3, max_model_len=96, page_size=8,
                    prefill_chunk=64, prefill_rows=2, chunk_steps=2, impl="reference")
    assert engine.warmup() == 11   # prefill: 1, 2 or 4 rows x 16 tokens, 1 or 2 x 64 (2 x 64 a call's most);
    #                                admit, grow, release; decode: 1, 2, 3 rows
    with compilations() as compiled:
        requests, outputs = _run(engine, _prompts(5, seed=41, longest=90), RequestParams(max_tokens=6))
    assert [name for name in compiled if any(step in name for step in ENGINE_PROGRAMS)] == []
    assert all(pieces[0].token_ids == r.token_ids[:1] for r, pieces in zip(requests, outputs))


def test_warmup_for_given_prompt_lengths_compiles_only_their_shapes(spec_pair, compilations):
    """``warmup(prompt_lengths=...)``: the shapes prompts of those lengths take (a 90-token prompt
    at chunk 64: a 64-token piece, then 26 padded to 64) and no others; such prompts then compile
    nothing more."""
    engine = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=3, max_model_len=128, page_size=8,
                    prefill_chunk=64, prefill_rows=2, chunk_steps=2, impl="reference")
    assert engine.warmup(prompt_lengths=[90]) == 8   # prefill: 1 or 2 rows x 64 tokens; 3 slot updates; 3 decodes
    rng = np.random.default_rng(7)
    with compilations() as compiled:
        _run(engine, [rng.integers(1, 120, size=90).tolist() for _ in range(3)], RequestParams(max_tokens=6))
    assert [name for name in compiled if any(step in name for step in ENGINE_PROGRAMS)] == []


def test_a_seeded_request_samples_the_same_beside_others(spec_pair):
    """A seeded request whose prompt takes several prefill chunks draws the same tokens alone and
    beside a decoding request (a row's key moves only with its own steps)."""
    rng = np.random.default_rng(0)
    long_prompt, other = rng.integers(1, 120, size=60).tolist(), rng.integers(1, 120, size=5).tolist()
    seeded = RequestParams(max_tokens=12, sampling=SamplingConfig(temperature=1.0), seed=123)
    settings = dict(max_num_seqs=2, max_model_len=96, page_size=8, prefill_chunk=16, chunk_steps=2, impl="reference")
    alone = _run(Engine(spec_pair.target, spec_pair.draft, **settings), [long_prompt], [seeded])[0][0]
    beside = _run(Engine(spec_pair.target, spec_pair.draft, **settings), [other, long_prompt],
                  [RequestParams(max_tokens=40), seeded])[0][1]
    assert beside.token_ids == alone.token_ids


def test_a_failed_step_aborts_its_requests_and_the_engine_goes_on(spec_pair, monkeypatch):
    """A device call that fails mid-run: every request holding a slot ends with "abort" and the
    error, its pages come back, the waiting ones then run as they would have."""
    from dflash_jax.runtime.engine import device

    real, calls = device.engine_chunk, []

    def fails_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            jax.tree.map(lambda x: x.delete(), args[2])   # as a failed call may leave its donated state
            raise RuntimeError("device fault")
        return real(*args, **kwargs)

    monkeypatch.setattr(device, "engine_chunk", fails_once)
    engine = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=2, max_model_len=96, page_size=8, chunk_steps=2,
                    impl="reference")
    prompts = _prompts(4, seed=51)
    finals = {}
    keep_last = lambda i: lambda out: out.finished and finals.setdefault(i, out)  # noqa: E731
    requests = [engine.submit(p, RequestParams(max_tokens=30), on_output=keep_last(i)) for i, p in enumerate(prompts)]
    with pytest.raises(RuntimeError, match="device fault"):
        engine.run_until_done()
    aborted = [i for i, o in finals.items() if o.finish_reason == "abort"]
    assert len(aborted) == 2 and all("device fault" in finals[i].error for i in aborted)
    assert engine.pages_in_use == 0 and engine.num_running == 0 and engine.cached_pages == 0   # a new pool
    engine.run_until_done()
    for i, request in enumerate(requests):
        if i not in aborted:
            alone = _alone(spec_pair.target, prompts[i], 30, spec_pair.draft)
            assert request.token_ids == alone and finals[i].finish_reason == "length"
    _check_idle(engine)


def test_the_default_pool_fits_the_free_device_memory(spec_pair, monkeypatch, caplog):
    """Without num_pages the pool is every slot at max_model_len, or what 90% of the device's
    free memory holds when that is less (with a warning); refused when not one request fits."""
    from dflash_jax.runtime.engine import device

    settings = dict(max_num_seqs=4, max_model_len=64, page_size=8, impl="reference")
    every_slot = 4 * -(-(64 + 16) // 8)
    monkeypatch.setattr(device, "device_free_bytes", lambda: None)              # a CPU reports nothing
    assert Engine(spec_pair.target, spec_pair.draft, **settings).num_pages == every_slot
    monkeypatch.setattr(device, "device_free_bytes", lambda: 10**12)
    assert Engine(spec_pair.target, spec_pair.draft, **settings).num_pages == every_slot
    # the target's and the draft's K and V pages: 6 layers x 2 x 8 tokens x 2 heads x 16 x 4 bytes
    per_page = 6 * 2 * 8 * 2 * 16 * 4
    monkeypatch.setattr(device, "device_free_bytes", lambda: int((25.5 * per_page) / 0.9))  # + page table
    with caplog.at_level("WARNING", logger="dflash_jax.runtime.engine"):
        assert Engine(spec_pair.target, spec_pair.draft, **settings).num_pages == 25
    assert "25 pages (200 tokens) fit" in caplog.text
    monkeypatch.setattr(device, "device_free_bytes", lambda: 5 * per_page)
    with pytest.raises(ValueError, match="not even one request of max_model_len 64 fits"):
        Engine(spec_pair.target, spec_pair.draft, **settings)


def test_request_keys_are_each_requests_own_key():
    """The admitted rows' keys, made in one program, are the per-request formula's: the seed's key
    (over the whole [0, 2**32) range), or the engine's key folded with the arrival number, then
    the sample index folded in."""
    from dflash_jax.runtime.engine.device import request_keys

    engine_key = jax.random.key(3)
    rows = [(7, None, 0), (9, 5, 2), (1, 2**32 - 1, 0), (2**20, None, 3), (0, 0, 1), (2**31, 2**31, 7)]

    def one(number, seed, index):
        key = jax.random.fold_in(engine_key, number) if seed is None else jax.random.key(seed)
        return jax.random.key_data(jax.random.fold_in(key, index))

    numbers, seeds, indices = (np.asarray(column, np.uint32) for column in
                               ([r[0] for r in rows], [r[1] or 0 for r in rows], [r[2] for r in rows]))
    keys = request_keys(engine_key, numbers, seeds, np.asarray([r[1] is not None for r in rows]), indices)
    np.testing.assert_array_equal(jax.random.key_data(keys), np.stack([one(*row) for row in rows]))


def test_adaptive_verification_keeps_greedy_tokens(spec_pair):
    """The adaptive policy: a step's time measured for each row bucket and width; then, with
    costs under which the best width follows each step's expected tokens, every request's
    greedy tokens equal those decoded alone with the whole block, several widths are verified,
    and the per-position counters add up. Each chunk runs as many rows as requests decode (one
    request: one row)."""
    engine = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=3, max_model_len=96, page_size=8, prefill_chunk=16,
                    chunk_steps=4, num_pages=40, impl="reference", speculative_policy="adaptive")
    assert engine.config.widths == (2, 4, 8, 16)
    measured = engine.device.calibrate(context=24, repeats=1)
    assert sorted(measured) == [1, 2, 3] and all(np.all(np.isfinite(c)) and np.all(c > 0) for c in measured.values())
    engine.device.step_costs = {rows: np.asarray([1.0, 1.5, 2.0, 2.5]) for rows in measured}
    chunk, rows_run = engine.device.chunk, []                 # (requests decoding, rows the chunk ran)
    engine.device.chunk = lambda owners, steps=None: rows_run.append((sum(r is not None for r in owners), len(
        (dispatched := chunk(owners, steps)).owners))) or dispatched
    prompts = _prompts(5, seed=17)
    max_tokens = [40, 12, 33, 1, 24]
    requests, _ = _run(engine, prompts, [RequestParams(max_tokens=m) for m in max_tokens])
    assert (1, 1) in rows_run and all(rows == count for count, rows in rows_run)   # buckets 1, 2, 3 of 3 slots
    for prompt, m, request in zip(prompts, max_tokens, requests):
        assert request.token_ids == _alone(spec_pair.target, prompt, m, spec_pair.draft)
    stats = engine.stats
    assert len({n for n in stats.verified_per_position if n}) > 1          # not every step the same width
    assert sum(stats.verified_per_position) == stats.num_draft_tokens
    assert sum(stats.accepted_per_position) == stats.num_accepted_tokens
    assert all(a <= r <= v for a, r, v in zip(stats.accepted_per_position, stats.reached_per_position,
                                               stats.verified_per_position))
    _check_idle(engine)


def test_a_burst_of_arrivals_is_prefilled_beside_decoding_within_the_step_budget(spec_pair):
    """Mixed steps: two requests decoding, then a burst of two long prompts. While prompts wait,
    every engine step runs a prefill call and a decode chunk holding every decoding request (a
    burst never stalls decoding); the chunk takes the steps that fit max_num_batched_tokens beside
    the prefill call (at least one), the step's tokens (prefill call + chunk steps x rows x block)
    stay within it unless one prefill row alone does not fit; chunks are shortened while prompts
    wait and whole once none does; greedy tokens equal decoding alone."""
    budget, block = 96, spec_pair.draft.config.block_size
    engine = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=4, max_model_len=96, page_size=8,
                    prefill_chunk=16, prefill_rows=2, chunk_steps=4, steps_per_check=1, num_pages=60,
                    impl="reference", max_num_batched_tokens=budget, prefix_caching=False)
    steps_log: list[dict] = []
    prefill, chunk = engine.device.prefill, engine.device.chunk

    def recorded_prefill(rows):
        count, tokens = engine.device.prefill_shape(len(rows), max(len(r.prompt_ids) - r.prefilled for r in rows))
        steps_log.append(dict(prefill=count * tokens, prefill_rows=len(rows)))
        return prefill(rows)

    def recorded_chunk(owners, steps=None):
        dispatched = chunk(owners, steps)
        entry = steps_log[-1] if steps_log and "steps" not in steps_log[-1] else steps_log.append({}) or steps_log[-1]
        entry.update(steps=steps, rows=len(dispatched.owners), owners={r for r in owners if r is not None},
                     waiting=bool(engine.scheduler.prefilling(1)))
        return dispatched

    engine.device.prefill, engine.device.chunk = recorded_prefill, recorded_chunk
    early = [engine.submit(p, RequestParams(max_tokens=30)) for p in _prompts(2, seed=5, longest=8)]
    while not all(r.decoding for r in early):
        engine.step()
    burst_prompts = np.random.default_rng(6).integers(1, 120, size=(2, 56)).tolist()   # 4 prefill calls each
    burst = [engine.submit(p, RequestParams(max_tokens=4)) for p in burst_prompts]
    steps_log.clear()
    engine.run_until_done()
    mixed = [s for s in steps_log if s.get("waiting")]
    assert len(mixed) >= 3
    for entry in mixed:
        assert "prefill" in entry and {r for r in early if not r.finished} <= entry["owners"]
        step_tokens = entry["rows"] * block
        assert entry["steps"] == max(1, min(engine.chunk_steps, (budget - entry["prefill"]) // step_tokens))
        assert entry["prefill"] + entry["steps"] * step_tokens <= budget or entry["prefill_rows"] == 1
    assert any(entry["steps"] < engine.chunk_steps for entry in mixed)
    assert any(s.get("steps") == engine.chunk_steps for s in steps_log if not s.get("waiting"))
    for prompt, m, request in zip(_prompts(2, seed=5, longest=8) + burst_prompts, [30] * 2 + [4] * 2, early + burst):
        assert request.token_ids == _alone(spec_pair.target, prompt, m, spec_pair.draft)
    _check_idle(engine)


def test_short_prompts_are_prefilled_more_rows_to_a_call(spec_pair):
    """A prefill call holds prefill_rows x prefill_chunk tokens: eight 12-token prompts (16-token
    pieces) go in one call of 8 rows where two 64-token pieces would; the greedy tokens are
    those of each prompt decoded alone."""
    engine = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=8, max_model_len=96, page_size=8,
                    prefill_chunk=64, prefill_rows=2, chunk_steps=2, impl="reference", prefix_caching=False)
    calls, prefill = [], engine.device.prefill
    engine.device.prefill = lambda rows: calls.append(len(rows)) or prefill(rows)
    prompts = np.random.default_rng(8).integers(1, 120, size=(8, 12)).tolist()
    requests, _ = _run(engine, prompts, RequestParams(max_tokens=5))
    assert calls == [8] and engine.device.prefill_shape(8, 12) == (8, 16)
    for prompt, request in zip(prompts, requests):
        assert request.token_ids == _alone(spec_pair.target, prompt, 5, spec_pair.draft)
    long_prompts = np.random.default_rng(9).integers(1, 120, size=(3, 40)).tolist()
    calls.clear()
    _run(engine, long_prompts, RequestParams(max_tokens=2))
    assert calls == [2, 1]
    _check_idle(engine)


def test_first_tokens_are_sent_before_the_decode_chunk_is_dispatched(spec_pair):
    """A request's first token goes out as its prefill ends, before the step dispatches the
    decode chunk that holds it (on a GPU that dispatch returns only when the chunk ends)."""
    engine = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=2, max_model_len=96, page_size=8,
                    prefill_chunk=64, prefill_rows=2, chunk_steps=2, impl="reference")
    delivered_at_dispatch, chunk = [], engine.device.chunk

    def recorded_chunk(owners, steps=None):
        delivered_at_dispatch.append([r.delivered for r in owners if r is not None])
        return chunk(owners, steps)

    engine.device.chunk = recorded_chunk
    prompts = _prompts(2, seed=12)
    requests, outputs = _run(engine, prompts, RequestParams(max_tokens=6))
    assert delivered_at_dispatch and all(d >= 1 for counts in delivered_at_dispatch for d in counts)
    for prompt, request in zip(prompts, requests):
        assert request.token_ids == _alone(spec_pair.target, prompt, 6, spec_pair.draft)


def test_the_adaptive_width_follows_expected_tokens_per_second():
    """``choose_width``: every draft accepted and costs growing slower than the block: the widest;
    nothing accepted: the narrowest; a width ruled out by an infinite cost is never chosen; a row
    with one token left counts only its bonus; done rows count nothing."""
    from types import SimpleNamespace

    from dflash_jax.runtime.decode import choose_width, expected_tokens

    def state(acceptance, remaining=(100, 100), done=(False, False)):
        rows = len(remaining)
        return SimpleNamespace(acceptance=jnp.full((rows, 15), acceptance, jnp.float32),
                               max_new_tokens=jnp.asarray(remaining, jnp.int32), num_generated=jnp.zeros(rows, jnp.int32),
                               done=jnp.asarray(done))

    widths, costs = (2, 4, 8, 16), jnp.asarray([1.0, 1.2, 1.5, 2.0])
    assert int(choose_width(state(1.0), costs, widths)) == 3
    assert int(choose_width(state(0.0), costs, widths)) == 0
    assert int(choose_width(state(1.0), costs.at[3].set(jnp.inf), widths)) == 2
    np.testing.assert_allclose(expected_tokens(state(1.0, remaining=(1, 100)), widths), [3, 5, 9, 17])
    np.testing.assert_allclose(expected_tokens(state(0.5, done=(True, False)), widths),
                               [1.5, 1.875, 1 + sum(0.5 ** i for i in range(1, 8)), 1 + sum(0.5 ** i for i in range(1, 16))],
                               rtol=1e-6)


def test_a_cached_prefix_is_reused_with_the_same_tokens_and_acceptance(spec_pair):
    """A second request on a 1,024-token prefix a first one left cached prefills only its own
    suffix (the draft's context comes from the same pages), and gives the tokens and acceptance
    lengths of the same request prefilled whole by an engine without prefix caching."""
    rng = np.random.default_rng(61)
    prefix = rng.integers(1, 120, size=1024).tolist()
    first, second = (prefix + rng.integers(1, 120, size=n).tolist() for n in (9, 13))
    settings = dict(max_num_seqs=2, max_model_len=1072, page_size=16, chunk_steps=4, impl="reference")
    params = RequestParams(max_tokens=32)
    engine = Engine(spec_pair.target, spec_pair.draft, **settings)
    _run(engine, [first], params)
    stats = engine.stats
    assert stats.prefill_tokens_computed == len(first) and stats.prefix_cache_hits == 0
    assert engine.cached_pages == 1024 // 16
    [hit], _ = _run(engine, [second], params)
    assert hit.cached_tokens == stats.prefix_cache_hits == 1024
    assert stats.prefill_tokens_computed == len(first) + 13
    assert stats.prefix_cache_queries == stats.prompt_tokens == len(first) + len(second)
    cold_engine = Engine(spec_pair.target, spec_pair.draft, prefix_caching=False, **settings)
    [cold], _ = _run(cold_engine, [second], params)
    assert cold_engine.stats.prefill_tokens_computed == len(second) and cold_engine.stats.prefix_cache_queries == 0
    assert hit.token_ids == cold.token_ids and hit.accept_lengths == cold.accept_lengths
    assert max(hit.accept_lengths) > 1
    _check_idle(engine)
    _check_idle(cold_engine)


@pytest.mark.parametrize("seed", [17, 29, 43])
def test_prefix_caching_under_random_arrivals_on_a_small_pool(spec_pair, seed):
    """Prompts of a few shared prefixes and random suffixes, arriving at random steps with random
    max_tokens, some cancelled, on a pool too small to keep every page cached: the page accounting
    holds after every step (a referenced page is never evicted), every request finishes, the
    greedy ones with their tokens alone, and every page comes back free or cached."""
    rng = random.Random(seed)
    engine = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=2, max_model_len=80, page_size=8,
                    prefill_chunk=8, chunk_steps=2, num_pages=24, impl="reference")
    prefixes = [[rng.randint(1, 119) for _ in range(n)] for n in (8, 17, 24)]
    prompts = [rng.choice(prefixes) + [rng.randint(1, 119) for _ in range(rng.randint(0, 20))] for _ in range(24)]
    submitted, finals = _random_arrivals(engine, prompts, rng, after_step=engine.scheduler.check_invariants)
    assert sorted(finals) == list(range(len(prompts)))
    for index, request in submitted.items():
        if request.cancelled:
            assert finals[index].finish_reason == "abort"
            continue
        assert finals[index].finish_reason == "length"
        assert request.token_ids == _alone(spec_pair.target, prompts[index], request.params.max_tokens,
                                           spec_pair.draft)
    assert any(r.cancelled for r in submitted.values())
    assert engine.stats.prefix_cache_hits > 0 and engine.scheduler.prefix_cache.evictions > 0
    _check_idle(engine)


def test_prefix_caching_is_refused_on_a_hybrid_by_name(spec_pair):
    """A target with a Gated DeltaNet layer (Qwen3.5 / Qwen3-Next) cannot restore its recurrent
    state at a cached prefix's end: prefix_caching=True is refused naming why and the server's
    flag; left unset, it is off."""
    config = spec_pair.target.config
    layers = (dataclasses.replace(config.layers[0], mixer=GatedDeltaNetSpec(1, 2, 16, 16)),) + config.layers[1:]
    hybrid = dataclasses.replace(spec_pair.target, config=dataclasses.replace(config, family="qwen3_5", layers=layers))
    assert prefix_caching_unsupported(config) is None
    with pytest.raises(ValueError, match=r"the target \(qwen3_5\) is a hybrid: its Gated DeltaNet layers \(1 of 4\) .*"
                                         r"--no-prefix-caching"):
        Engine(hybrid, prefix_caching=True, impl="reference")
    assert not Engine(hybrid, max_num_seqs=1, max_model_len=64, page_size=8, impl="reference").prefix_caching


def test_batch_invariant_greedy_tokens_in_bfloat16_alone_and_under_load(spec_pair):
    """``batch_invariant``: a bfloat16 request's greedy tokens are the same decoded alone and
    beside three greedy and four sampled requests of other lengths, every prefill call and decode
    chunk at one shape (XLA on a CPU gives a row the same numbers at any shape, so the tokens alone
    would not tell; the GPU kernels pick tiles by shape); the mode refuses the adaptive policy
    and leaves prefix caching off."""
    from dflash_jax.loading.models import load_draft, load_target

    target = load_target(spec_pair.target_dir, "bfloat16")
    draft = load_draft(spec_pair.draft_dir, target, "bfloat16")
    settings = dict(max_num_seqs=4, max_model_len=96, page_size=8, prefill_chunk=16, prefill_rows=4, chunk_steps=4,
                    impl="reference", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant needs speculative_policy 'fixed'"):
        Engine(target, draft, speculative_policy="adaptive", **settings)
    engine = Engine(target, draft, **settings)
    assert not engine.prefix_caching and engine.device.row_buckets == (4,)
    device, shapes = engine.device, set()       # on a CPU the numbers agree anyway: check the mechanism too
    prefill_call, chunk = device._prefill_call, device.chunk
    device._prefill_call = lambda slots, tokens, *rest: shapes.add(("prefill", tokens.shape)) or prefill_call(
        slots, tokens, *rest)
    device.chunk = lambda owners, steps=None: (dispatched := chunk(owners, steps),
                                               shapes.add(("chunk", len(dispatched.owners))))[0]
    prompts = _prompts(8, seed=23)
    greedy, sampled = RequestParams(max_tokens=24), RequestParams(max_tokens=24, sampling=SamplingConfig(temperature=1.0),
                                                                 seed=1)
    together, _ = _run(engine, prompts, [greedy] * 4 + [sampled] * 4)
    for prompt, request in zip(prompts[:4], together[:4]):
        [alone], _ = _run(engine, [prompt], greedy)
        assert alone.token_ids == request.token_ids
    assert shapes == {("prefill", (4, 16)), ("chunk", 4)}
    _check_idle(engine)


def test_a_failed_calibration_aborts_the_waiting_requests(spec_pair, monkeypatch):
    """Adaptive verification whose step-cost measurement fails: the step raises, the waiting
    request finishes with "abort" and the error (it is not left waiting), and a later request
    runs once the measurement works."""
    engine = Engine(spec_pair.target, spec_pair.draft, max_num_seqs=1, max_model_len=64, page_size=8, chunk_steps=2,
                    impl="reference", speculative_policy="adaptive")
    real = engine.device.calibrate
    monkeypatch.setattr(engine.device, "calibrate", lambda: (_ for _ in ()).throw(RuntimeError("device fault")))
    finals = []
    engine.submit([5, 6, 7], RequestParams(max_tokens=4), on_output=lambda out: out.finished and finals.append(out))
    with pytest.raises(RuntimeError, match="device fault"):
        engine.step()
    [final] = finals
    assert final.finish_reason == "abort" and "device fault" in final.error and engine.num_waiting == 0
    monkeypatch.setattr(engine.device, "calibrate", lambda: real(context=8, repeats=1))
    [request], _ = _run(engine, [[5, 6, 7]], RequestParams(max_tokens=4))
    assert request.token_ids == _alone(spec_pair.target, [5, 6, 7], 4, spec_pair.draft)
    _check_idle(engine)
