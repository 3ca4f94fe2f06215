//! What the benchmarks and the soak tests report: a process's memory, latency percentiles,
//! and the machine they ran on.

use anyhow::{Context, Result};

/// Memory of a process, from /proc/PID/status.
#[derive(Clone, Copy, Debug, Default)]
pub struct Memory {
    /// Resident set now (VmRSS).
    pub rss_kib: u64,
    /// Highest resident set since the process started (VmHWM).
    pub peak_kib: u64,
}

/// The memory of process `pid` now.
pub fn memory(pid: u32) -> Result<Memory> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .with_context(|| format!("cannot read /proc/{pid}/status"))?;
    let field = |name: &str| -> Result<u64> {
        status
            .lines()
            .find_map(|line| line.strip_prefix(name))
            .and_then(|rest| rest.split_whitespace().next())
            .and_then(|kib| kib.parse().ok())
            .with_context(|| format!("no {name} in /proc/{pid}/status"))
    };
    Ok(Memory {
        rss_kib: field("VmRSS:")?,
        peak_kib: field("VmHWM:")?,
    })
}

/// KiB in MiB, for reports.
pub fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}

/// Latency percentiles over recorded durations in microseconds (nearest-rank).
#[derive(Clone, Debug, Default)]
pub struct Percentiles {
    sorted: Vec<u32>,
}

impl Percentiles {
    pub fn new(mut micros: Vec<u32>) -> Percentiles {
        micros.sort_unstable();
        Percentiles { sorted: micros }
    }

    pub fn len(&self) -> usize {
        self.sorted.len()
    }

    pub fn is_empty(&self) -> bool {
        self.sorted.is_empty()
    }

    /// The `q` quantile (0..=1) in milliseconds; 0 when empty.
    pub fn ms(&self, q: f64) -> f64 {
        if self.sorted.is_empty() {
            return 0.0;
        }
        let rank = ((q * self.sorted.len() as f64).ceil() as usize).clamp(1, self.sorted.len());
        f64::from(self.sorted[rank - 1]) / 1000.0
    }

    pub fn mean_ms(&self) -> f64 {
        if self.sorted.is_empty() {
            return 0.0;
        }
        self.sorted.iter().map(|&v| f64::from(v)).sum::<f64>() / self.sorted.len() as f64 / 1000.0
    }

    /// Share of samples at or below `micros`.
    pub fn share_at_most(&self, micros: u32) -> f64 {
        if self.sorted.is_empty() {
            return 0.0;
        }
        self.sorted.partition_point(|&v| v <= micros) as f64 / self.sorted.len() as f64
    }
}

/// Rounds for the JSON line.
pub fn round(value: f64, digits: i32) -> f64 {
    let factor = 10f64.powi(digits);
    (value * factor).round() / factor
}

/// A short description of the machine, for the summary.
pub fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find_map(|l| l.strip_prefix("model name"))
                .map(|rest| rest.trim_start_matches([' ', '\t', ':']).to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let load: Vec<&str> = load.split_whitespace().take(3).collect();
    format!("{cores} cores ({cpu}), load average {}", load.join(" "))
}
