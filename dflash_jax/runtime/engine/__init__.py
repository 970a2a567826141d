"""The serving engine: slots, continuous batching, chunked ragged prefill, pages as requests grow.

One ``DecodeState`` of ``max_num_seqs`` slots stays on the device. Between decode chunks the host
admits waiting requests into free slots (by free slots and by pages not yet promised: a request
is admitted only when its whole worst case fits, so nothing runs out of pages mid-run; one that
can never fit is refused at once), runs one chunk of prompt tokens for the requests still
prefilling (each row its own start: no padding to the longest prompt, and a long prompt takes
one chunk per engine step instead of stalling the others for its whole prefill), hands out
pages as the requests grow and frees them when one finishes, is cancelled or fails. With prefix
caching, full prompt pages are kept by content and a request whose prompt starts with a cached
prefix starts on those pages (the target's K/V and the draft's context alike), prefilling only
the rest.

Host work overlaps device work: chunk k is dispatched before chunk k-1's tokens are read,
detokenized, checked for stop strings and delivered; so the host's view lags one chunk, and a
request stopped by a stop string or cancelled is released one chunk later (the tokens the
device made for it meanwhile are dropped). Each slot's window of new tokens is cut out on the
device (``decode.engine_chunk``), so the host reads a few KB a chunk.

Every request keeps its own sampling settings (``SamplingConfig``), seed, stop tokens and
strings and max_tokens in the one batch; DFlash stays exact per row (``sampling``).

Modules: ``request`` (a request's settings, outputs and progress), ``scheduler`` (queue, slots,
page accounting, admission), ``prefix_cache`` (cached prompt pages by chain hash, their
reference counts and eviction order), ``device`` (the decode state and the programs on it), ``output``
(tokens to text, stop strings and tokens, log-probabilities, finishing, counters) and ``core``
(``Engine``, which composes them and runs the steps).
"""

from dflash_jax.runtime.engine.core import PREFILL_CHUNK, Engine
from dflash_jax.runtime.engine.device import compile_seconds
from dflash_jax.runtime.engine.output import EngineStats
from dflash_jax.runtime.engine.request import MAX_STOP_TOKEN_IDS, Request, RequestOutput, RequestParams, TokenLogprob
from dflash_jax.runtime.engine.scheduler import QueueFullError

__all__ = ["MAX_STOP_TOKEN_IDS", "PREFILL_CHUNK", "Engine", "EngineStats", "QueueFullError", "Request",
           "RequestOutput", "RequestParams", "TokenLogprob", "compile_seconds"]
