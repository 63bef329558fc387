"""The text source of bench/quality.py: a fixed synthetic "language" with text-like statistics,
generated from a seed on the CPU (no download, the same tokens on every machine and device).

Each next token is drawn from a mixture of three sources, like an interpolated n-gram model:

* a unigram distribution over the vocabulary, Zipf-Mandelbrot shaped (p(rank k) ~ (k + 2.7)^-1.1,
  as for words of natural text): the "backoff" part, irreducible entropy;
* a class bigram: every token belongs to one of ``classes`` word classes (drawn at random), and each
  class has ``branch`` successors drawn from that unigram (frequent tokens are frequent successors),
  with Zipf-shaped weights over them: low-rank structure, as parts of speech give real text, which a
  small model learns within a few hundred steps;
* a trigram table over hashed contexts (the two previous tokens, hashed into ``buckets``): the same
  construction per context, so a model that attends two tokens back predicts better than one that
  does not, and a long tail of contexts to memorize keeps the loss falling.

Tokens 0 and 1 of a sequence start with the unigram. The source knows the true probability of every
token it emits, so its entropy rate (the loss of the Bayes predictor) is measured on the same tokens
(:meth:`Language.true_nll`): a floor no model can beat.
"""
from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class LanguageSpec:
    vocab: int = 1024
    branch: int = 16        # successors per class / trigram bucket
    classes: int = 32       # word classes of the bigram part
    buckets: int = 4096     # hashed two-token contexts
    mix: tuple = (0.1, 0.7, 0.2)  # unigram, class bigram, trigram weights (64 classes and (0.1, 0.6, 0.3)
    #   kept a 2 x 64 model on a plateau for ~200 steps, whose end varied by seed: bench/RESULTS.md)
    zipf_s: float = 1.1
    seed: int = 0           # the language itself (fixed across the runs' seeds)


def _zipf(n: int, s: float, shift: float = 2.7) -> torch.Tensor:
    w = (torch.arange(n, dtype=torch.float64) + shift) ** -s
    return w / w.sum()


class Language:
    """The fixed source: its tables are made from ``spec.seed`` alone."""

    def __init__(self, spec: LanguageSpec = LanguageSpec()):
        self.spec = spec
        v, k = spec.vocab, spec.branch
        g = torch.Generator().manual_seed(7919 + spec.seed)
        # the unigram over a random permutation of token ids (id order says nothing about frequency)
        ranks = torch.randperm(v, generator=g)
        self.unigram = torch.empty(v, dtype=torch.float64)
        self.unigram[ranks] = _zipf(v, spec.zipf_s)
        rank_weights = _zipf(k, 1.0, shift=1.0)

        def table(rows: int) -> tuple[torch.Tensor, torch.Tensor]:
            succ = torch.multinomial(self.unigram.expand(rows, v), k, replacement=False, generator=g)
            # each row's successors keep Zipf weights, in a random order of the drawn tokens, lightly jittered
            w = rank_weights[torch.argsort(torch.rand(rows, k, generator=g), dim=1)]
            w = w * torch.exp(0.3 * torch.randn(rows, k, generator=g, dtype=torch.float64))
            return succ, w / w.sum(dim=1, keepdim=True)

        self.token_class = torch.randint(0, spec.classes, (v,), generator=g)
        self.bi_next, self.bi_prob = table(spec.classes)
        self.tri_next, self.tri_prob = table(spec.buckets)
        self.mix = torch.tensor(spec.mix, dtype=torch.float64)
        self.mix = self.mix / self.mix.sum()
        self._uni_cdf = self.unigram.cumsum(0)
        self._bi_cdf = self.bi_prob.cumsum(1)
        self._tri_cdf = self.tri_prob.cumsum(1)
        self._mix_cdf = self.mix.cumsum(0)
        self._hash_a = 1_000_003
        self._hash_b = 7_919

    def bucket(self, prev2: torch.Tensor, prev1: torch.Tensor) -> torch.Tensor:
        return (prev2 * self._hash_a + prev1 * self._hash_b) % self.spec.buckets

    def sample(self, n: int, length: int, seed: int) -> torch.Tensor:
        """``n`` sequences of ``length`` tokens (int64, CPU), from the stream of ``seed`` (inverse-CDF
        draws: one uniform per choice, so the same seed gives the same tokens on every machine)."""
        g = torch.Generator().manual_seed(seed)
        out = torch.empty(n, length, dtype=torch.long)
        u = torch.rand(length, 2, n, 1, generator=g, dtype=torch.float64)
        out[:, 0] = self._draw(self._uni_cdf, u[0, 1]).squeeze(1)
        out[:, 1] = self._draw(self._uni_cdf, u[1, 1]).squeeze(1)
        for t in range(2, length):
            a, b = out[:, t - 2], out[:, t - 1]
            c = self.token_class[b]
            which = torch.searchsorted(self._mix_cdf, u[t, 0]).squeeze(1)
            h = self.bucket(a, b)
            cdf = torch.where((which == 1)[:, None], self._bi_cdf[c], self._tri_cdf[h])
            k = self._draw(cdf, u[t, 1]).squeeze(1)
            nxt = torch.where(which == 1, self.bi_next[c].gather(1, k[:, None]).squeeze(1),
                              self.tri_next[h].gather(1, k[:, None]).squeeze(1))
            uni = self._draw(self._uni_cdf, u[t, 1]).squeeze(1)
            out[:, t] = torch.where(which == 0, uni, nxt)
        return out

    @staticmethod
    def _draw(cdf: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """Inverse CDF per row: the first index whose cumulative probability exceeds u."""
        return torch.searchsorted(cdf, u, right=True).clamp_max(cdf.shape[-1] - 1)

    def prob(self, prev2: torch.Tensor, prev1: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """p(x | prev2, prev1) of the source at positions 2.. (float64, elementwise)."""
        c = self.token_class[prev1]
        bi = ((self.bi_next[c] == x[..., None]) * self.bi_prob[c]).sum(-1)
        h = self.bucket(prev2, prev1)
        tri = ((self.tri_next[h] == x[..., None]) * self.tri_prob[h]).sum(-1)
        return self.mix[0] * self.unigram[x] + self.mix[1] * bi + self.mix[2] * tri

    def true_nll(self, tokens: torch.Tensor) -> float:
        """Mean -log p(token | source) over positions 1.. (the targets of next-token prediction): the
        loss of the Bayes predictor on these tokens (position 1's context is one token: unigram)."""
        tokens = tokens.cpu()
        p = self.unigram[tokens[:, 1:]].clone()
        p[:, 1:] = self.prob(tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:])
        return float(-p.log().mean())
