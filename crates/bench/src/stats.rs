//! Summary statistics of one series of latency samples.
//!
//! Owns the arithmetic only: quantiles by linear interpolation between the
//! closest ranks (the "type 7" definition, numpy's and R's default), so the
//! median of an even count is the mean of the two middle samples. It does
//! not decide what a sample is or how it was taken.

use std::time::Duration;

use serde::Serialize;

/// The figures reported for one series, in milliseconds.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct Summary {
    /// Number of samples.
    pub n: usize,
    /// Median.
    pub p50_ms: f64,
    /// 95th percentile. With 30 samples this sits between the second and the
    /// third largest, so read it as "a slow case", not as a tail estimate.
    pub p95_ms: f64,
    /// Arithmetic mean.
    pub mean_ms: f64,
    /// Fastest sample.
    pub min_ms: f64,
    /// Slowest sample.
    pub max_ms: f64,
}

/// Summarises `samples`; `None` when there are none.
pub fn summarize(samples: &[Duration]) -> Option<Summary> {
    if samples.is_empty() {
        return None;
    }
    let mut ms: Vec<f64> = samples.iter().map(|d| d.as_secs_f64() * 1e3).collect();
    ms.sort_by(f64::total_cmp);
    let mean = ms.iter().sum::<f64>() / ms.len() as f64;
    Some(Summary {
        n: ms.len(),
        p50_ms: quantile(&ms, 0.50),
        p95_ms: quantile(&ms, 0.95),
        mean_ms: mean,
        min_ms: ms[0],
        max_ms: ms[ms.len() - 1],
    })
}

/// The `q` quantile (0..=1) of sorted, non-empty `sorted`, interpolating
/// linearly between the two closest ranks.
fn quantile(sorted: &[f64], q: f64) -> f64 {
    let pos = q * (sorted.len() - 1) as f64;
    let lower = pos.floor() as usize;
    let upper = pos.ceil() as usize;
    let weight = pos - lower as f64;
    sorted[lower] + (sorted[upper] - sorted[lower]) * weight
}

/// A summary of samples given in whole milliseconds, for the report tests.
#[cfg(test)]
pub fn summary_of_ms(v: &[u64]) -> Summary {
    let samples: Vec<Duration> = v.iter().map(|&m| Duration::from_millis(m)).collect();
    summarize(&samples).expect("samples")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(values: &[u64]) -> Vec<Duration> {
        values.iter().map(|&v| Duration::from_millis(v)).collect()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn nothing_to_summarise() {
        assert_eq!(summarize(&[]), None);
    }

    #[test]
    fn one_sample_is_every_figure() {
        let s = summarize(&ms(&[7])).unwrap();
        assert_eq!(s.n, 1);
        for v in [s.p50_ms, s.p95_ms, s.mean_ms, s.min_ms, s.max_ms] {
            assert!(close(v, 7.0));
        }
    }

    #[test]
    fn order_of_samples_does_not_matter() {
        let s = summarize(&ms(&[5, 1, 4, 2, 3])).unwrap();
        assert!(close(s.p50_ms, 3.0));
        assert!(close(s.min_ms, 1.0));
        assert!(close(s.max_ms, 5.0));
        assert!(close(s.mean_ms, 3.0));
        // 0.95 * 4 = 3.8: 80 % of the way from 4 to 5.
        assert!(close(s.p95_ms, 4.8));
    }

    #[test]
    fn even_count_median_is_the_mean_of_the_middle_two() {
        let s = summarize(&ms(&[1, 2, 3, 10])).unwrap();
        assert!(close(s.p50_ms, 2.5));
    }

    #[test]
    fn p95_of_one_to_a_hundred() {
        let samples: Vec<u64> = (1..=100).collect();
        let s = summarize(&ms(&samples)).unwrap();
        assert!(close(s.p95_ms, 95.05));
        assert!(close(s.p50_ms, 50.5));
    }
}
