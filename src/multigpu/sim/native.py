"""The built-in SIR / movement kernels (and CartPole's step) as one C loop each, compiled on first use (pure;
inside each rank).

Why: torch.compile's CPU code generator (torch 2.13) does not vectorize int16,
and agent positions are int16, so the compiled movement and transition kernels
run one agent at a time. These loops compute exactly what the torch kernels in
:mod:`multigpu.sim.models` compute (the same hash, thresholds, wrap-around and
counts; the torch kernels stay the specification and the fallback, and the
tests compare the two bit for bit), in one pass per chunk, and the C compiler
vectorizes them (``-O3 -march=native``).

The library is built with the C compiler that torch.compile uses (``cc``, or
``$CC``) into ``$XDG_CACHE_HOME/multigpu/native`` (default ``~/.cache``), keyed
by the source, the flags and the CPU, and loaded with :mod:`ctypes` (which
releases the GIL during a call). It is loaded only from a folder and a file
this user owns and no one else can write (checked on the open file, which is
the one loaded); otherwise it is built in a private temporary folder and one
line says why. Where no compiler works, :func:`kernels` returns ``{}`` and the
engine keeps the torch kernels.

CartPole's step (``mg_cartpole_step``, :func:`cartpole_step`) is in the same library: one set of C kernels,
built and loaded in one place; :mod:`multigpu.envs.cartpole` calls it on CPU environments.

    ks = native.kernels()            # {"move": ..., "infected": ..., "transition": ...} or {}
    order = native.row_order(y, 1000)  # stable argsort of int16 rows by counting (None without the library)
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import stat
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from multigpu import envvars

__all__ = ["available", "cartpole_step", "kernels", "outside", "group", "net_batch_step", "permute", "random_graph",
           "row_order", "spread"]

_SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

static inline uint32_t bits_of(int32_t id, uint32_t key) {
    uint32_t x = ((uint32_t)id * 0x9E3779B1u) ^ key;   /* rng.random_bits: lowbias32 of id * golden ^ key */
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
    return x;
}

/* models.move_kernel: returns the number of agents that moved. */
int64_t mg_move(const int32_t *restrict ids, int16_t *restrict x, int16_t *restrict y, int64_t n, uint32_t key, int32_t move_thr,
                int32_t height, int32_t width) {
    int64_t moved = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t b = bits_of(ids[i], key);
        int32_t m = (int32_t)(b & 0xFFFFu) < move_thr;
        int32_t d = (int32_t)((b >> 16) & 3u);
        int32_t nx = x[i] + m * ((d == 0) - (d == 1));
        int32_t ny = y[i] + m * ((d == 2) - (d == 3));
        nx += (nx < 0) * width - (nx >= width) * width;
        ny += (ny < 0) * height - (ny >= height) * height;
        x[i] = (int16_t)nx; y[i] = (int16_t)ny;
        moved += m;
    }
    return moved;
}

/* models.move_count_kernel: move a block of agents (vectorized), then, while the block is in L1, add its
   infected agents (state 2) to their cells of rows [lo, lo + rows) and note the positions of the agents
   outside those rows (about to migrate) in away; *naway = their count. Returns the number that moved.
   Each agent's cell (or the drop slot) and 0/1 are computed in a vectorized loop; the cells of the infected ones
   are then compacted (AVX-512: a compress per 16 agents, no branch; else a branch-free scalar loop) and only
   those are added, one by one (adding 0 for every other agent was most of this kernel's time: 10.6 -> 6.1 ms
   for 5M agents at 0.5% infected, 11.1 -> 7.7 ms at 6.5%). Agents are sorted by row: the next row's counts are
   prefetched when a block reaches a new row, and most blocks have no agent outside the rows and skip the search. */
int64_t mg_move_count(const int32_t *restrict ids, int16_t *restrict x, int16_t *restrict y,
                      const uint8_t *restrict state, int64_t n, uint32_t key, int32_t move_thr, int32_t height,
                      int32_t width, int32_t *restrict acc, int64_t lo, int64_t rows, int64_t *restrict away,
                      int64_t *restrict naway) {
    const int32_t lo32 = (int32_t)lo, rows32 = (int32_t)rows, ncells = rows32 * width;
    int64_t moved = 0, k = 0;
    int32_t fetched = -1;
    int32_t cells[2048], inc[2048], hit[2048 + 16];
    for (int64_t a = 0; a < n; a += 2048) {
        int64_t m = n - a < 2048 ? n - a : 2048;
        moved += mg_move(ids + a, x + a, y + a, m, key, move_thr, height, width);
        const int16_t *restrict yb = y + a, *restrict xb = x + a;
        const uint8_t *restrict sb = state + a;
        int32_t out = 0;
        {   /* agents are sorted by row: bring the next row's cells into cache before its agents count there */
            int32_t next = (int32_t)yb[m - 1] - lo32 + 1;
            if (next != fetched && (uint32_t)next < (uint32_t)rows32) {
                for (int32_t l = 0; l < width; l += 16) __builtin_prefetch(acc + (int64_t)next * width + l, 1, 3);
                fetched = next;
            }
        }
        for (int64_t j = 0; j < m; j++) {
            int32_t r = (int32_t)yb[j] - lo32;
            int32_t in = (uint32_t)r < (uint32_t)rows32;
            int32_t c = r * width + (int32_t)xb[j];
            cells[j] = c ^ ((c ^ ncells) & (in - 1));   /* in ? c : ncells, without a branch */
            inc[j] = sb[j] == 2;
            out |= in ^ 1;
        }
        int32_t nin = 0;   /* the infected agents' cells, compacted: the scatter-add visits only them */
#if defined(__AVX512F__)
        int64_t j = 0;
        for (; j + 16 <= m; j += 16) {
            __m512i c = _mm512_loadu_si512((const void *)(cells + j));
            __m512i v = _mm512_loadu_si512((const void *)(inc + j));
            __mmask16 mk = _mm512_test_epi32_mask(v, v);
            _mm512_storeu_si512((void *)(hit + nin), _mm512_maskz_compress_epi32(mk, c));   /* no branch */
            nin += __builtin_popcount(mk);
        }
        for (; j < m; j++) { hit[nin] = cells[j]; nin += inc[j]; }
#else
        for (int64_t j = 0; j < m; j++) { hit[nin] = cells[j]; nin += inc[j]; }
#endif
        for (int32_t t = 0; t < nin; t++) acc[hit[t]] += 1;
        if (out) {
            for (int64_t j = 0; j < m; j++) {
                away[k] = a + j;
                k += (uint32_t)((int32_t)yb[j] - lo32) >= (uint32_t)rows32;
            }
        }
    }
    acc[ncells] = 0;
    *naway = k;
    return moved;
}

/* models.infected_kernel: acc[cell] += 1 for infected agents (state 2) on this rank's cells. */
void mg_infected(int32_t *restrict acc, int64_t ncells, const int16_t *restrict x, const int16_t *restrict y,
                 const uint8_t *restrict state,
                 int64_t n, int64_t lo, int64_t width) {
    for (int64_t i = 0; i < n; i++) {
        int64_t cell = ((int64_t)y[i] - lo) * width + x[i];
        int64_t ok = (state[i] == 2) & (cell >= 0) & (cell < ncells);
        acc[ok ? cell : ncells] += 1;   /* acc[ncells] is the drop slot: no branch to mispredict */
    }
    acc[ncells] = 0;
}

/* The positions i with y[i] outside [lo, hi) (agents that leave this rank's rows), in order; returns their count. */
int64_t mg_outside(const int16_t *restrict y, int64_t n, int64_t lo, int64_t hi, int64_t *restrict index) {
    int64_t k = 0;
    for (int64_t i = 0; i < n; i++) {
        index[k] = i;
        k += (y[i] < lo) | (y[i] >= hi);
    }
    return k;
}

/* models.transition_kernel: counts[k] = agents in state k afterwards; returns -1 on an index out of range.
   The next row's cell thresholds are prefetched as a block of agents (sorted by row) reaches a new row.
   Branch-free (every load unconditional, in range) so that the compiler vectorizes it; the next states are
   packed in one word (a variable shift instead of a chain of selects) and counted in int32 per block of
   4096 agents (about 1.15x and 1.35x faster than selects and int64 counters, measured here). */
int64_t mg_transition(const int32_t *restrict ids, const int16_t *restrict x, const int16_t *restrict y, uint8_t *restrict state, int64_t n,
                      uint32_t key, const int32_t *restrict cell_thr, int64_t ncells, int64_t lo, int64_t width,
                      const int32_t *state_thr, const uint8_t *next_state, int64_t *restrict counts) {
    const int32_t t1 = state_thr[1], t2 = state_thr[2], t3 = state_thr[3];   /* S uses its cell's threshold */
    const uint32_t packed = (uint32_t)next_state[0] | (uint32_t)next_state[1] << 8 | (uint32_t)next_state[2] << 16
                            | (uint32_t)next_state[3] << 24;
    const int32_t lo32 = (int32_t)lo, w32 = (int32_t)width;
    int64_t c0 = 0, c1 = 0, c2 = 0;
    int32_t bad = 0;
    int32_t fetched = -1;
    for (int64_t a = 0; a < n; a += 4096) {
        int64_t b = n - a < 4096 ? n : a + 4096;
        int32_t d0 = 0, d1 = 0, d2 = 0;
        {   /* the next row's cell thresholds, fetched while this block's agents are done (sorted by row) */
            int32_t next = (int32_t)y[b - 1] - lo32 + 1;
            if (next != fetched && next >= 0 && (int64_t)(next + 1) * w32 <= ncells) {
                for (int32_t l = 0; l < w32; l += 16) __builtin_prefetch(cell_thr + (int64_t)next * w32 + l, 0, 3);
                fetched = next;
            }
        }
        for (int64_t i = a; i < b; i++) {
            int32_t u = (int32_t)((bits_of(ids[i], key) >> 8) & 0xFFFFFFu);
            int32_t cell = ((int32_t)y[i] - lo32) * w32 + (int32_t)x[i];   /* |cell| < 2^31: grid <= 32767^2 */
            uint32_t s = state[i];
            int32_t ok = (uint32_t)cell < (uint32_t)ncells;
            bad |= (!ok) | (s > 3);
            int32_t tc = cell_thr[cell & -ok];
            int32_t thr = s == 0 ? tc : s == 1 ? t1 : s == 2 ? t2 : t3;
            int32_t nx = (int32_t)((packed >> ((s & 3) * 8)) & 0xFFu);
            int32_t nw = u < thr ? nx : (int32_t)s;
            state[i] = (uint8_t)nw;
            d0 += nw == 0; d1 += nw == 1; d2 += nw == 2;
        }
        c0 += d0; c1 += d1; c2 += d2;
    }
    counts[0] = c0; counts[1] = c1; counts[2] = c2; counts[3] = n - c0 - c1 - c2;
    return bad ? -1 : 0;
}

/* models.thresholds_kernel: out[c] = table[min(counts[c], ntable - 1)] (counts >= 0); returns -1 on a negative count. */
int64_t mg_thresholds(const int32_t *restrict table, int64_t ntable, const int32_t *restrict counts, int64_t n,
                      int32_t *restrict out) {
    const int32_t top = (int32_t)(ntable - 1);
    int32_t bad = 0;
    for (int64_t c = 0; c < n; c++) {
        int32_t k = counts[c];
        bad |= k < 0;
        out[c] = table[k < 0 ? 0 : k > top ? top : k];
    }
    return bad ? -1 : 0;
}

/* data[k] = data[order[k]] for k < n (a permutation of 1-, 2-, 4- or 8-byte elements), through scratch:
   the gather torch's index_select does, as one typed loop (the agents are nearly sorted when it runs, so
   order[k] stays near k and the reads stay in cache). Returns -1 on an element size it does not know. */
int64_t mg_permute(void *restrict data, int64_t n, int64_t elsize, const int64_t *restrict order,
                   void *restrict scratch) {
    switch (elsize) {
    case 1: { const uint8_t *s = data; uint8_t *d = scratch; for (int64_t k = 0; k < n; k++) d[k] = s[order[k]]; break; }
    case 2: { const uint16_t *s = data; uint16_t *d = scratch; for (int64_t k = 0; k < n; k++) d[k] = s[order[k]]; break; }
    case 4: { const uint32_t *s = data; uint32_t *d = scratch; for (int64_t k = 0; k < n; k++) d[k] = s[order[k]]; break; }
    case 8: { const uint64_t *s = data; uint64_t *d = scratch; for (int64_t k = 0; k < n; k++) d[k] = s[order[k]]; break; }
    default: return -1;
    }
    memcpy(data, scratch, (size_t)(n * elsize));
    return 0;
}

/* The network step (sim.network.spread): out[targets[e]] += values[s] for every edge e out of a source s with a
   nonzero value, edges grouped by source (ptr, int32). -1 where a target is outside out. */
int64_t mg_spread(const int32_t *restrict ptr, const int32_t *restrict targets, const int64_t *restrict values,
                  int64_t n, int64_t *restrict out, int64_t nout) {
    for (int64_t s = 0; s < n; s++) {
        int64_t v = values[s];
        if (!v) continue;
        for (int32_t e = ptr[s]; e < ptr[s + 1]; e++) {
            uint32_t t = (uint32_t)targets[e];
            if (t >= (uint64_t)nout) return -1;
            out[t] += v;
        }
    }
    return 0;
}

/* One step of the batched network_sir (sim.batch), in one pass each: reps replicates of n agents (row b * n + j is
   agent j of replicate b, keyed keys[b]), edges grouped by source over every row. inbox: scratch of reps * n.
   counts[b * 3 + 0..2]: S, I, R of replicate b after the step. -1 where an edge ends outside the rows. */
int64_t mg_net_batch_step(const int32_t *restrict ptr, const int32_t *restrict targets, const int32_t *restrict ids,
                          uint8_t *restrict state, int64_t reps, int64_t n, const uint32_t *restrict keys,
                          const int32_t *restrict table, int64_t ntable, int32_t recover, int32_t *restrict inbox,
                          int64_t *restrict counts) {
    int64_t rows = reps * n;
    memset(inbox, 0, (size_t)rows * sizeof(int32_t));
    for (int64_t s = 0; s < rows; s++) {
        if (state[s] != 2) continue;
        for (int32_t e = ptr[s]; e < ptr[s + 1]; e++) {
            uint32_t t = (uint32_t)targets[e];
            if (t >= (uint64_t)rows) return -1;
            inbox[t] += 1;
        }
    }
    int32_t last = table[ntable - 1];
    for (int64_t b = 0; b < reps; b++) {
        int64_t cs = 0, ci = 0, cr = 0;
        uint32_t key = keys[b];
        uint8_t *st = state + b * n;
        const int32_t *in = inbox + b * n;
        for (int64_t j = 0; j < n; j++) {
            int32_t u = (int32_t)((bits_of(ids[j], key) >> 8) & 0xFFFFFFu);
            int32_t thr = in[j] < ntable ? table[in[j]] : last;
            uint8_t old = st[j];
            uint8_t nw = (old == 0 && u < thr) ? 2 : (old == 2 && u < recover) ? 3 : old;
            st[j] = nw;
            cs += nw == 0; ci += nw == 2; cr += nw == 3;
        }
        counts[b * 3] = cs; counts[b * 3 + 1] = ci; counts[b * 3 + 2] = cr;
    }
    return 0;
}

/* network.by_source as a stable counting sort: ptr[s]..ptr[s + 1] (int32) index the targets of source s. -1 where
   a source is outside 0..n-1. */
int64_t mg_group(const int64_t *restrict src, const int64_t *restrict dst, int64_t e, int64_t n,
                 int32_t *restrict ptr, int32_t *restrict targets) {
    memset(ptr, 0, (size_t)(n + 1) * sizeof(int32_t));
    for (int64_t i = 0; i < e; i++) {
        if ((uint64_t)src[i] >= (uint64_t)n) return -1;
        ptr[src[i] + 1]++;
    }
    for (int64_t s = 0; s < n; s++) ptr[s + 1] += ptr[s];
    for (int64_t i = 0; i < e; i++) targets[ptr[src[i]]++] = (int32_t)dst[i];   /* ptr[s] walks to s's end */
    for (int64_t s = n; s > 0; s--) ptr[s] = ptr[s - 1];
    ptr[0] = 0;
    return 0;
}

/* sim.network's random graph on one rank (kind=random: households of one), grouped by destination as
   Graph(incoming(...), use_native=True) groups it: agent i links to partner p = ((bits_of(i, keys[k]) & 0x7FFFFFFF)
   * n) >> 31 for each k; every link is an edge both ways, self-links left out. Into each destination d, in the
   stable sort's order of `incoming` (the links as (i -> p), k-major then i, then the same flipped): first the
   sources i with p_k(i) = d, then the partners p_k(d). ptr[n + 1] and src[edges] int32; returns the edge count. */
static inline int64_t partner_of(int64_t i, uint32_t key, int64_t n) {
    return ((int64_t)(bits_of((int32_t)i, key) & 0x7FFFFFFFu) * n) >> 31;
}

int64_t mg_random_graph(int64_t n, int64_t contacts, const int32_t *restrict keys, int32_t *restrict ptr,
                        int32_t *restrict src) {
    memset(ptr, 0, (size_t)(n + 1) * sizeof(int32_t));
    for (int64_t k = 0; k < contacts; k++)
        for (int64_t i = 0; i < n; i++) {
            int64_t q = partner_of(i, (uint32_t)keys[k], n);
            if (q != i) { ptr[q + 1]++; ptr[i + 1]++; }
        }
    for (int64_t d = 0; d < n; d++) ptr[d + 1] += ptr[d];
    for (int64_t k = 0; k < contacts; k++)          /* the links as given: i -> p */
        for (int64_t i = 0; i < n; i++) {
            int64_t q = partner_of(i, (uint32_t)keys[k], n);
            if (q != i) src[ptr[q]++] = (int32_t)i;
        }
    for (int64_t k = 0; k < contacts; k++)          /* then flipped: p -> i */
        for (int64_t i = 0; i < n; i++) {
            int64_t q = partner_of(i, (uint32_t)keys[k], n);
            if (q != i) src[ptr[i]++] = (int32_t)q;
        }
    for (int64_t d = n; d > 0; d--) ptr[d] = ptr[d - 1];   /* each ptr[d] walked to d's end: shift back */
    ptr[0] = 0;
    return ptr[n];
}

/* The same for bool values: each edge out of a source with on[s] adds one. */
int64_t mg_spread_on(const int32_t *restrict ptr, const int32_t *restrict targets, const uint8_t *restrict on,
                     int64_t n, int64_t *restrict out, int64_t nout) {
    for (int64_t s = 0; s < n; s++) {
        if (!on[s]) continue;
        for (int32_t e = ptr[s]; e < ptr[s + 1]; e++) {
            uint32_t t = (uint32_t)targets[e];
            if (t >= (uint64_t)nout) return -1;
            out[t] += 1;
        }
    }
    return 0;
}

/* network_sir's transition (models.net_transition_kernel): S (0) -> I (2) where the draw is under thr, I -> R (3)
   under recover; counts[0..2] = S, I, R after it. */
void mg_net_transition(const int32_t *restrict ids, uint8_t *restrict state, const int32_t *restrict thr,
                       int64_t n, uint32_t key, int32_t recover, int64_t *restrict counts) {
    int64_t cs = 0, ci = 0, cr = 0;
    for (int64_t j = 0; j < n; j++) {
        int32_t u = (int32_t)((bits_of(ids[j], key) >> 8) & 0xFFFFFFu);
        uint8_t st = state[j];
        uint8_t nw = (st == 0 && u < thr[j]) ? 2 : (st == 2 && u < recover) ? 3 : st;
        state[j] = nw;
        cs += nw == 0; ci += nw == 2; cr += nw == 3;
    }
    counts[0] = cs; counts[1] = ci; counts[2] = cr;
}

/* A stable argsort of rows y in [0, rows) by counting: order[k] = the position of the k-th agent. */
int64_t mg_row_order(const int16_t *restrict y, int64_t n, int64_t rows, int64_t *restrict offsets,
                     int64_t *restrict order) {
    memset(offsets, 0, (size_t)(rows + 1) * sizeof(int64_t));
    for (int64_t i = 0; i < n; i++) {
        int64_t r = y[i];
        if (r < 0 || r >= rows) return -1;
        offsets[r + 1] += 1;
    }
    for (int64_t r = 0; r < rows; r++) offsets[r + 1] += offsets[r];
    for (int64_t i = 0; i < n; i++) order[offsets[y[i]]++] = i;
    return 0;
}

/* envs CartPole-v1 (multigpu.envs.cartpole), float32, next-step autoreset: one step of n environments, what the
   torch formulation (CartPole._dynamics and VectorEnv.step) computes, bit for bit. torch's addcmul and
   add(alpha=) are fma(v * t1, t2, self) and fma(t, alpha, self): explicit fmaf here. Every other product feeds a
   multiply, a division, an fmaf or a difference that is exact, except the reset draw's, which a volatile keeps
   from being fused with its add (-ffp-contract=fast would; NumPy rounds twice). sin and cos of theta come from
   torch (its SLEEF kernels), in sc (2, n).
   p: the buffers, as addresses (see multigpu.envs.cartpole._native_setup); k: the float32 constants.
   Three passes: the actions to 0/1; the dynamics of every environment, branch-free (vectorized); then the few
   that ended last step are reset (found a word of 8 flags at a time). Returns the largest elapsed count. */
static inline uint32_t mix32(uint32_t x) {
    x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16;
    return x;
}

/* Separate, with restrict parameters: inside mg_cartpole_step (pointers derived from one another) the compiler
   did not vectorize it. */
__attribute__((noinline))
static void cartpole_dynamics(float *restrict x, float *restrict xd, float *restrict th, float *restrict thd,
                              const float *restrict sin_th, const float *restrict cos_th,
                              const float *restrict force, int64_t n, const float *restrict k) {
    const float pml = k[0], den_c = k[1], inv_m = k[2], g = k[3], xacc_c = k[4], den0 = k[7], tau = k[8];
    for (int64_t i = 0; i < n; i++) {
        float s = sin_th[i], c = cos_th[i], v = thd[i];
        float temp = fmaf(pml * (v * v), s, force[i]) * inv_m;
        float denom = fmaf(den_c * c, c, den0);
        float thacc = fmaf(-c, temp, s * g) / denom;
        float xacc = fmaf(xacc_c * thacc, c, temp);
        x[i] = fmaf(xd[i], tau, x[i]);                                     /* positions move with the old velocities */
        xd[i] = fmaf(xacc, tau, xd[i]);
        th[i] = fmaf(v, tau, th[i]);
        thd[i] = fmaf(thacc, tau, v);
    }
}

int64_t mg_cartpole_step(const int64_t *restrict p, int64_t n, int64_t action_bytes, int32_t limit,
                         const float *restrict k) {
    float *restrict x = (float *)p[0], *restrict xd = x + n, *restrict th = x + 2 * n, *restrict thd = x + 3 * n;
    const float *restrict sin_th = (const float *)p[1], *restrict cos_th = sin_th + n;
    int32_t *restrict elapsed = (int32_t *)p[3];
    int64_t *restrict resets = (int64_t *)p[4];
    uint8_t *restrict prev_done = (uint8_t *)p[5];
    uint8_t *restrict stale = (uint8_t *)p[6];
    const uint32_t *restrict keys = (const uint32_t *)p[7];
    float *restrict obs = (float *)p[8];
    float *restrict reward = (float *)p[9];
    uint8_t *restrict terminated = (uint8_t *)p[10];
    uint8_t *restrict truncated = (uint8_t *)p[11];
    float *restrict force = (float *)p[12];
    const float two_force = k[5], force_mag = k[6], x_thr = k[9], th_thr = k[10];
    /* each pass has one element type, or two, so that the compiler vectorizes it (one loop of all: it did not) */
    if (action_bytes == 8) {
        const int64_t *a = (const int64_t *)p[2];
        for (int64_t i = 0; i < n; i++) force[i] = (a[i] > 0 ? two_force : 0.0f) - force_mag;  /* clamp(a,0,1)*2F-F */
    } else if (action_bytes == 4) {
        const int32_t *a = (const int32_t *)p[2];
        for (int64_t i = 0; i < n; i++) force[i] = (a[i] > 0 ? two_force : 0.0f) - force_mag;
    } else {
        const uint8_t *a = (const uint8_t *)p[2];
        for (int64_t i = 0; i < n; i++) force[i] = (a[i] > 0 ? two_force : 0.0f) - force_mag;
    }
    cartpole_dynamics(x, xd, th, thd, sin_th, cos_th, force, n, k);
    for (int64_t i = 0; i < n; i++)   /* not inside: |x| > 2.4 or |theta| > 12 degrees, or NaN */
        terminated[i] = ((fabsf(x[i]) <= x_thr) & (fabsf(th[i]) <= th_thr) & 1) ^ 1;
    for (int64_t i = 0; i < n; i++) terminated[i] &= prev_done[i] ^ 1;   /* one that ended last step resets */
    for (int64_t i = 0; i < n; i++) elapsed[i] = prev_done[i] ? 0 : elapsed[i] + 1;
    for (int64_t i = 0; i < n; i++) truncated[i] = elapsed[i] >= limit;   /* 0 after a reset: limit >= 1 */
    for (int64_t i = 0; i < n; i++) reward[i] = prev_done[i] ? 0.0f : 1.0f;
    for (int64_t w = 0; w < n; w += 8) {   /* the few that ended last step: a word of 8 flags at a time */
        uint64_t word = 0;
        memcpy(&word, prev_done + w, (size_t)(n - w < 8 ? n - w : 8));
        if (!word) continue;
        for (int64_t i = w; i < w + 8 && i < n; i++) {
            if (!prev_done[i]) continue;
            uint32_t base = mix32(keys[i] ^ (uint32_t)resets[i] * 0x9E3779B9u);   /* its next initial state */
            for (int j = 0; j < 4; j++) {
                int32_t bits = (int32_t)(mix32(base ^ (uint32_t)(j + 1) * 0x85EBCA6Bu) >> 8);
                volatile float scaled = (float)bits * k[15 + j];              /* rounded twice, as the NumPy draw */
                x[j * n + i] = scaled + k[11 + j];
            }
            resets[i] += 1; stale[i] = 1;
        }
    }
    memcpy(obs, x, (size_t)(4 * n) * sizeof(float));
    for (int64_t i = 0; i < n; i++) prev_done[i] = terminated[i] | truncated[i];
    int32_t most = 0;
    for (int64_t i = 0; i < n; i++) most = elapsed[i] > most ? elapsed[i] : most;
    return most;
}
"""

_FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-fno-strict-aliasing"]
_LOCK = threading.Lock()
_LIB: ctypes.CDLL | None | bool = None  # None: not tried; False: no library here


def _cpu_tag() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return "|".join([platform.machine(), *lines])


def _cache_path(cc: str) -> Path:
    """Where the library built by ``cc`` for this source, these flags and this CPU is kept."""
    digest = hashlib.sha256("\0".join([_SOURCE, cc, *_FLAGS, _cpu_tag()]).encode()).hexdigest()[:16]
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "multigpu" / "native"
    return root / f"sim_{digest}.so"


def _compile(cc: str, folder: Path, path: Path) -> None:
    """Build the library into ``path`` (ranks may build at once: each compiles into its own temporary folder
    inside ``folder``, then renames its file in place); owner-only modes."""
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        src, out = Path(tmp) / "sim.c", Path(tmp) / "sim.so"
        src.write_text(_SOURCE)
        subprocess.run([cc, *_FLAGS, str(src), "-o", str(out)], check=True, capture_output=True, timeout=120)
        out.chmod(0o700)
        os.replace(out, path)


def _not_private(st: os.stat_result, what: str) -> str | None:
    """Why a folder or file of stat ``st`` is not this user's alone (None: it is)."""
    if st.st_uid != os.geteuid():
        return f"the {what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
    if st.st_mode & 0o022:
        return f"the {what} is writable by others than its owner (mode {st.st_mode & 0o777:o})"
    return None


def _folder_problem(folder: Path) -> str | None:
    """Why ``folder`` is not this user's alone (None: it is)."""
    try:
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        return f"the folder cannot be opened as a folder ({exc.strerror})"
    try:
        return _not_private(os.fstat(fd), "folder")
    finally:
        os.close(fd)


def _open_private(path: Path) -> tuple[int | None, str | None]:
    """``(descriptor, None)`` of the library at ``path`` when its folder and the file are owned by this user
    and writable by no one else, checked on what was opened (no symbolic link followed at the last step of
    either), so the file checked is the file loaded; ``(None, None)`` when the folder is private but holds no
    such file yet (or does not exist); else ``(None, why not)``."""
    try:
        folder = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except FileNotFoundError:
        return None, None
    except OSError as exc:
        return None, f"the folder cannot be opened as a folder ({exc.strerror})"
    try:
        why = _not_private(os.fstat(folder), "folder")
        if why is not None:
            return None, why
        try:
            fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=folder)
        except FileNotFoundError:
            return None, None
        except OSError as exc:
            return None, f"the file cannot be opened ({exc.strerror})"
        st = os.fstat(fd)
        why = _not_private(st, "file") or (None if stat.S_ISREG(st.st_mode) else "the file is not a regular file")
        if why is not None:
            os.close(fd)
            return None, why
        return fd, None
    finally:
        os.close(folder)


def _load(fd: int, path: Path) -> ctypes.CDLL:
    """dlopen the file open as ``fd`` (by /proc/self/fd where there is one, so that nothing can swap the file
    between the check and the load), then close the descriptor."""
    try:
        proc = f"/proc/self/fd/{fd}"
        return ctypes.CDLL(proc if os.path.exists(proc) else str(path))
    finally:
        os.close(fd)


def _say_once(line: str) -> None:
    from multigpu.runtime import group
    from multigpu.runtime.logging import get_logger

    if group.rank() == 0:
        get_logger().warning(line)


def _build() -> ctypes.CDLL | bool:
    """Load the cached library, building it first where there is none.

    A library is loaded only from a folder and a file this user owns and no one else can write: another user
    who controls the folder ``XDG_CACHE_HOME`` names could otherwise plant one whose constructor runs in every
    rank (the file name is computed from public inputs). Where the cache is not private the library is built
    in a private temporary folder, loaded from there and deleted, and rank 0 says why, once.
    """
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None or os.environ.get(envvars.NATIVE, "1") == "0":
        return False
    path = _cache_path(cc)
    try:
        fd, why = _open_private(path)
        if fd is None and why is None:  # none built yet: build it in the (private) cache, then open it
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            why = _folder_problem(path.parent)  # checked before anything is built in it
            if why is None:
                _compile(cc, path.parent, path)
                fd, why = _open_private(path)
        if fd is not None:
            lib = _load(fd, path)
        else:
            _say_once(f"sim: the compiled kernels in {path.parent} are not used ({why}); they were built in a "
                      "private temporary folder instead (point XDG_CACHE_HOME at a folder of your own to keep them)")
            with tempfile.TemporaryDirectory(prefix="multigpu_native_") as tmp:  # mode 0700, removed after the load
                private = Path(tmp) / path.name
                _compile(cc, Path(tmp), private)
                fd, _ = _open_private(private)
                if fd is None:
                    return False
                lib = _load(fd, private)
    except (OSError, subprocess.SubprocessError):
        return False
    i64, u32, i32, p = ctypes.c_int64, ctypes.c_uint32, ctypes.c_int32, ctypes.c_void_p
    lib.mg_move.argtypes = [p, p, p, i64, u32, i32, i32, i32]
    lib.mg_move.restype = i64
    lib.mg_infected.argtypes = [p, i64, p, p, p, i64, i64, i64]
    lib.mg_infected.restype = None
    lib.mg_transition.argtypes = [p, p, p, p, i64, u32, p, i64, i64, i64, p, p, p]
    lib.mg_transition.restype = i64
    lib.mg_outside.argtypes = [p, i64, i64, i64, p]
    lib.mg_outside.restype = i64
    lib.mg_move_count.argtypes = [p, p, p, p, i64, u32, i32, i32, i32, p, i64, i64, p, p]
    lib.mg_move_count.restype = i64
    lib.mg_thresholds.argtypes = [p, i64, p, i64, p]
    lib.mg_thresholds.restype = i64
    lib.mg_permute.argtypes = [p, i64, i64, p, p]
    lib.mg_permute.restype = i64
    lib.mg_row_order.argtypes = [p, i64, i64, p, p]
    lib.mg_row_order.restype = i64
    lib.mg_spread.argtypes = lib.mg_spread_on.argtypes = [p, p, p, i64, p, i64]
    lib.mg_spread.restype = lib.mg_spread_on.restype = i64
    lib.mg_net_transition.argtypes = [p, p, p, i64, u32, i32, p]
    lib.mg_group.argtypes = [p, p, i64, i64, p, p]
    lib.mg_random_graph.argtypes = [i64, i64, p, p, p]
    lib.mg_random_graph.restype = i64
    lib.mg_net_batch_step.argtypes = [p, p, p, p, i64, i64, p, p, i64, i32, p, p]
    lib.mg_net_batch_step.restype = i64
    lib.mg_group.restype = i64
    lib.mg_net_transition.restype = None
    return lib


def _lib() -> ctypes.CDLL | None:
    global _LIB
    with _LOCK:
        if _LIB is None:
            _LIB = _build()
    return _LIB or None


def available() -> bool:
    """Whether the C kernels could be built and loaded on this machine."""
    return _lib() is not None


def _ok(*pairs: tuple[torch.Tensor, torch.dtype]) -> bool:
    return all(t.dtype == dt and t.device.type == "cpu" and t.is_contiguous() for t, dt in pairs)


def _key(key: int) -> int:
    return key & 0xFFFFFFFF


def kernels() -> dict:
    """Native versions of ``models.KERNELS`` (same signatures and results), or ``{}`` where none can be built.

    Each falls back to the torch kernel for inputs it does not handle (another dtype or device,
    non-contiguous views, a multi-channel accumulator).
    """
    lib = _lib()
    if lib is None:
        return {}
    from multigpu.sim import models

    def move(ids, x, y, key, move_thr, height, width):
        if not _ok((ids, torch.int32), (x, torch.int16), (y, torch.int16)):
            return models.move_kernel(ids, x, y, key, move_thr, height, width)
        moved = lib.mg_move(ids.data_ptr(), x.data_ptr(), y.data_ptr(), ids.numel(), _key(key), move_thr,
                            height, width)
        return torch.tensor(moved, dtype=torch.int64)

    def infected(acc, x, y, state, lo, width):
        if acc.dim() != 1 or not _ok((acc, torch.int32), (x, torch.int16), (y, torch.int16), (state, torch.uint8)):
            return models.infected_kernel(acc, x, y, state, lo, width)
        lib.mg_infected(acc.data_ptr(), acc.numel() - 1, x.data_ptr(), y.data_ptr(), state.data_ptr(), x.numel(),
                        lo, width)
        return None

    def transition(ids, x, y, state, key, cell_thr, lo, width, state_thr, next_state):
        if not (_ok((ids, torch.int32), (x, torch.int16), (y, torch.int16), (state, torch.uint8),
                    (cell_thr, torch.int32), (state_thr, torch.int32), (next_state, torch.uint8))
                and state_thr.numel() == 4 and next_state.numel() == 4):
            return models.transition_kernel(ids, x, y, state, key, cell_thr, lo, width, state_thr, next_state)
        counts = torch.zeros(4, dtype=torch.int64)
        rc = lib.mg_transition(ids.data_ptr(), x.data_ptr(), y.data_ptr(), state.data_ptr(), ids.numel(), _key(key),
                               cell_thr.data_ptr(), cell_thr.numel(), lo, width, state_thr.data_ptr(),
                               next_state.data_ptr(), counts.data_ptr())
        if rc != 0:
            raise IndexError("sim transition: an agent's cell is outside this rank's rows, or its state is not "
                             "0..3 (S, E, I, R)")
        return counts

    def move_count(ids, x, y, state, key, move_thr, height, width, acc, lo):
        if acc.dim() != 1 or not _ok((ids, torch.int32), (x, torch.int16), (y, torch.int16), (state, torch.uint8),
                                     (acc, torch.int32)):
            return models.move_count_kernel(ids, x, y, state, key, move_thr, height, width, acc, lo)
        away = torch.empty(ids.numel(), dtype=torch.int64)
        naway = torch.zeros(1, dtype=torch.int64)
        moved = lib.mg_move_count(ids.data_ptr(), x.data_ptr(), y.data_ptr(), state.data_ptr(), ids.numel(),
                                  _key(key), move_thr, height, width, acc.data_ptr(), lo,
                                  (acc.numel() - 1) // width, away.data_ptr(), naway.data_ptr())
        return torch.tensor(moved, dtype=torch.int64), away[: int(naway)]

    def thresholds(table, counts):
        if not _ok((table, torch.int32), (counts, torch.int32)) or table.numel() == 0:
            return models.thresholds_kernel(table, counts)
        out = torch.empty(counts.numel(), dtype=torch.int32)
        if lib.mg_thresholds(table.data_ptr(), table.numel(), counts.data_ptr(), counts.numel(), out.data_ptr()):
            raise IndexError("sim thresholds: a negative infected count")
        return out

    def net_transition(ids, state, thr, key, recover):
        if not _ok((ids, torch.int32), (state, torch.uint8), (thr, torch.int32)):
            return models.net_transition_kernel(ids, state, thr, key, recover)
        counts = torch.zeros(3, dtype=torch.int64)
        lib.mg_net_transition(ids.data_ptr(), state.data_ptr(), thr.data_ptr(), ids.numel(), _key(key), recover,
                              counts.data_ptr())
        return counts

    return {"move": move, "infected": infected, "transition": transition, "move_count": move_count,
            "thresholds": thresholds, "net_transition": net_transition}


def net_batch_step(ptr: torch.Tensor, targets: torch.Tensor, ids: torch.Tensor, state: torch.Tensor, keys: list[int],
                   table: torch.Tensor, recover: int, inbox: torch.Tensor, counts: torch.Tensor) -> bool:
    """One step of the batched network_sir (:func:`multigpu.sim.batch.run_batch`) in C: the infected's edges
    counted, then each agent's transition; ``counts`` [replicates, 3] (S, I, R) filled. False without the library
    or for other dtypes (the caller runs the torch code)."""
    lib = _lib()
    reps, n = len(keys), ids.numel()
    if lib is None or table.numel() == 0 or not _ok((ptr, torch.int32), (targets, torch.int32), (ids, torch.int32),
                                                    (state, torch.uint8), (table, torch.int32),
                                                    (inbox, torch.int32), (counts, torch.int64)):
        return False
    if state.numel() != reps * n or inbox.numel() != reps * n or ptr.numel() != reps * n + 1:
        return False
    k = torch.tensor([_key(key) for key in keys], dtype=torch.int64).to(torch.int32)
    if lib.mg_net_batch_step(ptr.data_ptr(), targets.data_ptr(), ids.data_ptr(), state.data_ptr(), reps, n,
                             k.data_ptr(), table.data_ptr(), table.numel(), recover, inbox.data_ptr(),
                             counts.data_ptr()):
        raise IndexError("sim network: an edge ends outside the agents it is summed into")
    return True

def group(src: torch.Tensor, dst: torch.Tensor, num_src: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """:func:`multigpu.sim.network.by_source` as one counting sort in C (int64 ``src``/``dst``, int32 results);
    None without the library or where the counts do not fit int32."""
    lib = _lib()
    if lib is None or not _ok((src, torch.int64), (dst, torch.int64)) or max(num_src, src.numel()) >= 1 << 31:
        return None
    ptr = torch.empty(num_src + 1, dtype=torch.int32)
    targets = torch.empty(src.numel(), dtype=torch.int32)
    if lib.mg_group(src.data_ptr(), dst.data_ptr(), src.numel(), num_src, ptr.data_ptr(), targets.data_ptr()):
        raise IndexError(f"sim network: an edge starts outside agents 0..{num_src - 1}")
    return ptr, targets


def random_graph(n: int, keys: list[int]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """One rank's whole random network (sim.network ``kind=random``), its edges grouped by destination in C:
    ``(ptr [n + 1], sources)`` int32, the order :class:`multigpu.sim.network.Graph` sorts them into; None without
    the library or where the edges do not fit int32."""
    lib = _lib()
    if lib is None or 2 * n * len(keys) >= 1 << 31:
        return None
    ptr = torch.empty(n + 1, dtype=torch.int32)
    src = torch.empty(2 * n * len(keys), dtype=torch.int32)  # at most: self-links are left out
    k = torch.tensor([_key(key) for key in keys], dtype=torch.int64).to(torch.int32)
    edges = lib.mg_random_graph(n, len(keys), k.data_ptr(), ptr.data_ptr(), src.data_ptr())
    return ptr, src[:edges]


def spread(ptr: torch.Tensor, targets: torch.Tensor, values: torch.Tensor, out: torch.Tensor) -> bool:
    """:func:`multigpu.sim.network.spread` in one C loop (int32 edges, int64 or bool values, int64 ``out``): True
    where it ran, False without the library or for other dtypes (the caller runs the torch code)."""
    lib = _lib()
    on = values.dtype == torch.bool
    if lib is None or values.numel() != ptr.numel() - 1 or not _ok((ptr, torch.int32), (targets, torch.int32),
                                                                  (out, torch.int64),
                              (values, torch.bool if on else torch.int64)):
        return False
    run = lib.mg_spread_on if on else lib.mg_spread
    if run(ptr.data_ptr(), targets.data_ptr(), values.data_ptr(), values.numel(), out.data_ptr(), out.numel()):
        raise IndexError("sim network: an edge ends outside the agents it is summed into")
    return True


def cartpole_step():
    """The C step of :mod:`multigpu.envs.cartpole` (``mg_cartpole_step``), or None without the library."""
    lib = _lib()
    if lib is None:
        return None
    step = lib.mg_cartpole_step
    step.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]
    step.restype = ctypes.c_int64
    return step


def row_order(y: torch.Tensor, rows: int) -> torch.Tensor | None:
    """``torch.argsort(y, stable=True)`` for int16 rows in ``[0, rows)``, by counting; None without the library."""
    lib = _lib()
    if lib is None or not _ok((y, torch.int16)):
        return None
    offsets = torch.empty(rows + 1, dtype=torch.int64)
    order = torch.empty(y.numel(), dtype=torch.int64)
    if lib.mg_row_order(y.data_ptr(), y.numel(), rows, offsets.data_ptr(), order.data_ptr()) != 0:
        raise IndexError(f"sim sort: a row outside 0..{rows - 1}")
    return order


def permute(fields: list[torch.Tensor], order: torch.Tensor) -> bool:
    """``f.copy_(torch.index_select(f, 0, order))`` for each 1-D field, in C; False (nothing done) without the library
    or for a field it does not take (not contiguous CPU, elements not of 1, 2, 4 or 8 bytes)."""
    lib = _lib()
    sizes = {f.element_size() for f in fields}
    if (lib is None or not _ok((order, torch.int64)) or not sizes <= {1, 2, 4, 8}
            or any(f.dim() != 1 or f.numel() != order.numel() or not _ok((f, f.dtype)) for f in fields)):
        return False
    scratch = torch.empty(order.numel() * max(sizes, default=1), dtype=torch.uint8)
    for f in fields:
        lib.mg_permute(f.data_ptr(), f.numel(), f.element_size(), order.data_ptr(), scratch.data_ptr())
    return True


def outside(y: torch.Tensor, lo: int, hi: int) -> torch.Tensor | None:
    """``torch.nonzero((y < lo) | (y >= hi)).reshape(-1)`` for int16 ``y``; None without the library."""
    lib = _lib()
    if lib is None or not _ok((y, torch.int16)):
        return None
    index = torch.empty(y.numel(), dtype=torch.int64)
    k = lib.mg_outside(y.data_ptr(), y.numel(), lo, hi, index.data_ptr())
    return index[:k]
