"""T5-style span corruption (Raffel et al. 2020, section 3.1.4): a packed token block -> an encoder input
with sentinels where spans were dropped, and a decoder target that lists the dropped spans.

    block   : a b c d e f g h i j
    noise   :     ^ ^       ^
    encoder : a b <s0> e f g h <s1> i j
    target  : <s0> c d <s1> h </s>      decoder input: <pad> <s0> c d <s1> h

The arithmetic is T5's `random_spans_noise_mask` (`span_counts`, in the encoder-decoder family's module
models/families/encdec/__init__.py, where the config's checks read it too): of a block of L tokens, exactly
round(L * noise_density) (at least 1, at most L - 1) are noise, in exactly
max(1, round(noise / mean_span_length)) spans; the noise and the kept tokens are each cut into that many
non-empty runs at uniformly random places, and the runs alternate kept, noise, kept, noise, ... so a block
starts with kept text and ends with a noise span. Every block of a given length therefore gives the same
encoder length (L - noise + spans) and decoder length (noise + spans + 1 for the EOS): batches need no
padding and no loss mask, and the loss counts exactly the decoder's targets.

Why at load time, not in the tokenize stage (a deliberate deviation from issue #20's wording, which has
the tokenize stage pack encoder and decoder blocks): the tokenize stage and its artifact stay the same
for every architecture (plain packed blocks of seq_len + 1 tokens), so nothing in the data stages knows
about objectives; and corrupting each block when it is read draws fresh noise every epoch, as T5's
on-the-fly preprocessing does, where noise fixed in the artifact would be the same in every epoch.

Determinism: the noise of a block is a pure function of (run seed, salt, the block's tokens), with the
salt the optimizer step in training and a constant in evaluation. It needs no sample index from the
loader (whose layout is another module's business), it is the same on every rank layout (the global
batch of a step is, see pipeline.training.loader), and a block read again in another epoch (another step)
gets other noise. Two equal blocks in one step get equal noise, which changes nothing.

Sentinels: the tokenizer reserves `sentinel_symbols(n)` as user-defined symbols after the configured
ones (pipeline.stages.tokenizer), so sentinel k has id `first_sentinel_id + k` and the ids are known
from the config alone.

Shape legend: B blocks, L block length, S encoder length, T decoder length.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from typing import TYPE_CHECKING

import numpy as np

from models.families import family
from models.families.encdec import span_counts
from pipeline.tokenization.spm import EOS_ID, NUM_SPECIAL, PAD_ID

if TYPE_CHECKING:  # torch is imported where batches are made: the tokenizer stage reads the counts without it
    import torch

DECODER_START_ID = PAD_ID  # the decoder's first input, as in T5 and Marian
EVAL_SALT = -1  # the salt of evaluation's noise (training's is the step, >= 0)


def sentinel_symbols(n: int) -> list[str]:
    """The n sentinel pieces, T5's spelling: <extra_id_0>, <extra_id_1>, ..."""
    return [f"<extra_id_{k}>" for k in range(n)]


@dataclass(frozen=True)
class SpanCorruption:
    """The objective's settings and the sentinel ids.

    Attributes:
        noise_density: fraction of a block's tokens that are dropped into spans.
        mean_span_length: mean length of a span.
        first_sentinel_id: id of <extra_id_0>; sentinel k is first_sentinel_id + k.
        seed: the run seed.
    """

    noise_density: float
    mean_span_length: float
    first_sentinel_id: int
    seed: int

    def lengths(self, block_len: int) -> tuple[int, int]:
        """(encoder length S, decoder length T) of every block of `block_len` tokens."""
        noise, spans = span_counts(block_len, self.noise_density, self.mean_span_length)
        return block_len - noise + spans, noise + spans + 1

    def noise_mask(self, block: np.ndarray, salt: int) -> np.ndarray:
        """The (L,) bool noise mask of one block (True = dropped into a span)."""
        L = len(block)
        noise, spans = span_counts(L, self.noise_density, self.mean_span_length)
        digest = hashlib.blake2b(np.ascontiguousarray(block, dtype=np.int64).tobytes(), digest_size=8).digest()
        rng = np.random.default_rng([self.seed, salt + 1, int.from_bytes(digest, "little")])

        def segment(total: int) -> np.ndarray:  # `spans` non-empty run lengths summing to `total`
            cuts = np.sort(rng.choice(np.arange(1, total), size=spans - 1, replace=False))
            return np.diff(np.concatenate([[0], cuts, [total]]))

        noise_runs, kept_runs = segment(noise), segment(L - noise)
        runs = np.stack([kept_runs, noise_runs], axis=1).reshape(-1)  # kept, noise, kept, noise, ...
        is_noise_run = np.tile([False, True], spans)
        return np.repeat(is_noise_run, runs)

    def corrupt(self, block: np.ndarray, salt: int) -> tuple[np.ndarray, np.ndarray]:
        """(encoder ids (S,), decoder targets (T,)) of one block."""
        mask = self.noise_mask(block, salt)
        starts = mask & ~np.concatenate([[False], mask[:-1]])  # first token of each span
        sentinel = self.first_sentinel_id + np.cumsum(starts) - 1
        # Encoder: kept tokens, and each span's first token replaced by its sentinel (the rest dropped).
        encoder = np.where(starts, sentinel, block)[~mask | starts]
        # Decoder targets: each span preceded by its sentinel, then EOS.
        noise_pos = np.flatnonzero(mask)
        is_start = starts[noise_pos]
        slot = np.arange(len(noise_pos)) + np.cumsum(is_start)  # where each noise token goes
        targets = np.empty(len(noise_pos) + int(is_start.sum()) + 1, dtype=np.int64)
        targets[slot] = block[noise_pos]
        targets[slot[is_start] - 1] = self.first_sentinel_id + np.arange(int(is_start.sum()))
        targets[-1] = EOS_ID
        return encoder.astype(np.int64), targets

    def batch(self, blocks_BL: torch.Tensor, salt: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(encoder ids (B, S), decoder inputs (B, T), decoder targets (B, T)) of a batch of blocks."""
        import torch

        pairs = [self.corrupt(b, salt) for b in blocks_BL.cpu().numpy()]
        enc_BS = torch.from_numpy(np.stack([p[0] for p in pairs]))
        tgt_BT = torch.from_numpy(np.stack([p[1] for p in pairs]))
        dec_in_BT = torch.cat([torch.full_like(tgt_BT[:, :1], DECODER_START_ID), tgt_BT[:, :-1]], dim=1)
        return enc_BS, dec_in_BT, tgt_BT


def first_sentinel_id(user_defined_symbols: list[str]) -> int:
    """Id of <extra_id_0>: the sentinels follow the special pieces and the configured symbols."""
    return NUM_SPECIAL + len(user_defined_symbols)


def for_run(cfg) -> SpanCorruption | None:
    """The objective of a run (a ``pipeline.config.RunConfig``): None unless model.arch is encoder_decoder."""
    mc = cfg.model_config()
    if not family(mc).seq2seq:
        return None
    return SpanCorruption(mc.denoise_noise_density, mc.denoise_mean_span_length,
                          first_sentinel_id(cfg.tokenizer.user_defined_symbols), cfg.run.seed)


def num_sentinels(cfg) -> int:
    """How many sentinels the run's tokenizer reserves: the spans of one block (0 for a decoder run)."""
    corruption = for_run(cfg)
    if corruption is None:
        return 0
    return span_counts(cfg.tokenize.seq_len + 1, corruption.noise_density, corruption.mean_span_length)[1]


def corrupt_micro_batches(corruption: SpanCorruption, micro_batches: list[tuple[torch.Tensor, torch.Tensor]],
                          salt: int) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """The loader's (inputs, targets) micro-batches -> (encoder ids, decoder inputs, decoder targets).

    The loader hands each block of seq_len + 1 tokens as inputs = block[:-1] and targets = block[1:];
    the block is cat(inputs, targets[:, -1:]).
    """
    import torch

    out = []
    for inputs_BT, targets_BT in micro_batches:
        blocks_BL = torch.cat([inputs_BT, targets_BT[:, -1:]], dim=1)
        out.append(corruption.batch(blocks_BL, salt))
    return out
