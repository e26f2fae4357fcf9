//! The bench process's CPU time (user + system, every thread), read from `/proc/self/stat`:
//! the workers run inside this process, so CPU over a drain divided by its events is the
//! client's CPU per event (issue 15). Linux only; elsewhere the figure reads zero.

use std::time::Duration;

/// Clock ticks per second of `/proc/self/stat`'s `utime` and `stime` (`USER_HZ`, 100 on
/// every Linux architecture the bench runs on).
const TICKS_PER_SECOND: u64 = 100;

/// The process's CPU time when it was read.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ProcessCpu(Duration);

impl ProcessCpu {
    /// Reads the process's CPU time so far.
    pub(crate) fn now() -> Self {
        Self(read().unwrap_or_default())
    }

    /// Microseconds of CPU per event since `self` was read.
    pub(crate) fn per_event_us(self, events: usize) -> f64 {
        let spent = Self::now().0.saturating_sub(self.0);
        spent.as_secs_f64() * 1e6 / events.max(1) as f64
    }
}

/// `utime + stime` of `/proc/self/stat` (fields 14 and 15; the command name, field 2, is in
/// parentheses and may hold spaces, so fields are counted after its closing parenthesis).
fn read() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let after_name = &stat[stat.rfind(')')? + 1..];
    let mut fields = after_name.split_whitespace().skip(11);
    let user: u64 = fields.next()?.parse().ok()?;
    let system: u64 = fields.next()?.parse().ok()?;
    Some(Duration::from_millis(
        (user + system) * 1000 / TICKS_PER_SECOND,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_time_is_read_and_grows_with_work() {
        let before = read().expect("/proc/self/stat is readable on Linux");
        let mut x = 0_u64;
        let began = std::time::Instant::now();
        while began.elapsed() < Duration::from_millis(100) {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
        }
        std::hint::black_box(x);
        let after = read().unwrap();
        assert!(after > before, "{before:?} -> {after:?}");
    }
}
