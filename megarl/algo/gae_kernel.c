/* GAE on CPU: verl's per-step recurrence in float64, one pass over memory per row.
 *
 * Built on first use by megarl/algo/native.py (cc -O2 -ffp-contract=off) and called through
 * ctypes from megarl/algo/gae.py; the vectorized torch code there is the reference and the path
 * for every other device. Semantics (masked positions: advantage 0, returns = values) and the
 * order of every floating-point operation follow the Python recurrence, so that the float64
 * results are bit-identical to it.
 */
#include <stdint.h>

/* Rows [begin, end) of row-major [B, T] inputs. raw receives the float64 advantages, returns
 * raw + values in the input type. stats[0..2] += number of valid tokens, sum of advantages, sum
 * of their squares. Returns 0, or -1 when a mask entry is neither 0 nor 1. */
#define DEFINE_GAE(NAME, REAL)                                                                   \
    int NAME(const REAL *rewards, const REAL *values, const REAL *mask, double *raw,            \
             REAL *returns, int64_t begin, int64_t end, int64_t T, double gamma, double lam,    \
             double *stats) {                                                                    \
        const double decay = gamma * lam;                                                        \
        double count = 0.0, sum = 0.0, square_sum = 0.0;                                         \
        for (int64_t b = begin; b < end; ++b) {                                                  \
            const REAL *r = rewards + b * T, *v = values + b * T, *m = mask + b * T;             \
            double *a = raw + b * T;                                                             \
            REAL *ret = returns + b * T;                                                         \
            double next_value = 0.0, advantage = 0.0;                                            \
            for (int64_t t = T - 1; t >= 0; --t) {                                               \
                const double value = (double)v[t];                                               \
                if (m[t] == (REAL)1) {                                                           \
                    const double delta = (double)r[t] + gamma * next_value - value;              \
                    advantage = delta + decay * advantage;                                       \
                    next_value = value;                                                          \
                    a[t] = advantage;                                                            \
                    ret[t] = (REAL)(advantage + value);                                          \
                    count += 1.0;                                                                \
                    sum += advantage;                                                            \
                    square_sum += advantage * advantage;                                         \
                } else if (m[t] == (REAL)0) {                                                    \
                    a[t] = 0.0;                                                                  \
                    ret[t] = v[t];                                                               \
                } else {                                                                         \
                    return -1;                                                                   \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
        stats[0] += count;                                                                       \
        stats[1] += sum;                                                                         \
        stats[2] += square_sum;                                                                  \
        return 0;                                                                                \
    }

/* out[i] = (raw[i] - mean) * scale for i in [begin, end): verl's masked_whiten, applied to
 * every position with statistics from the valid ones. */
#define DEFINE_WHITEN(NAME, REAL)                                                                \
    void NAME(const double *raw, REAL *out, int64_t begin, int64_t end, double mean,            \
              double scale) {                                                                    \
        for (int64_t i = begin; i < end; ++i) out[i] = (REAL)((raw[i] - mean) * scale);          \
    }

DEFINE_GAE(gae_rows_f32, float)
DEFINE_GAE(gae_rows_f64, double)
DEFINE_WHITEN(whiten_f32, float)
DEFINE_WHITEN(whiten_f64, double)
