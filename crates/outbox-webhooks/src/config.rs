//! How deliveries are sent, retried and given up on.

use std::time::Duration;

use crate::client::AddressPolicy;

/// The waits after the first, second, … failed attempt of a delivery (before jitter): about
/// 8.5 hours from the first attempt to the ninth. How many of them a delivery gets is the
/// workers' `MaxRetryAttempts` (5 by default: the first three, about 2.6 minutes, then the
/// endpoint is disabled before the last attempt; raise it for the deliveries' workers to span
/// hours). Past the end the last one repeats.
pub const DEFAULT_RETRY_SCHEDULE: [Duration; 8] = [
    Duration::from_secs(5),
    Duration::from_secs(30),
    Duration::from_secs(2 * 60),
    Duration::from_secs(10 * 60),
    Duration::from_secs(30 * 60),
    Duration::from_secs(60 * 60),
    Duration::from_secs(2 * 60 * 60),
    Duration::from_secs(5 * 60 * 60),
];

/// The sender's settings.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// Resolving and connecting (and the TLS handshake): 5 s.
    pub connect_timeout: Duration,
    /// The whole request, connection included: 15 s.
    pub total_timeout: Duration,
    /// The waits between attempts ([`DEFAULT_RETRY_SCHEDULE`]); each is jittered by up to
    /// ±20%.
    pub retry_schedule: Vec<Duration>,
    /// The bounds a receiver's `Retry-After` is held to (1 s to 1 h).
    pub retry_after_bounds: (Duration, Duration),
    /// Failed attempts in a row (any delivery of the endpoint) after which the endpoint is
    /// disabled: 50. A success resets the count.
    pub disable_after_failures: i32,
    /// The largest body the fan-out freezes for a delivery: 256 KiB. A larger event fails its
    /// fan-out (`failed` at once, with the reason), it is never cut.
    pub max_body_bytes: usize,
    /// How long the previous secret still signs after a rotation: 24 h.
    pub rotation_overlap: Duration,
    /// Which addresses sends may reach (public ones only, by default).
    pub addresses: AddressPolicy,
    /// Idle keep-alive connections kept per host and port: 16.
    pub idle_per_host: usize,
    /// The workers' `MaxRetryAttempts` ([`WebhookConfig::for_workers`]): a delivery's failure
    /// that leaves it one attempt disables its endpoint instead of letting it end `failed`.
    pub max_attempts: i32,
    /// A send that takes this long (answered, or still in flight) makes its endpoint slow: 5 s.
    pub slow_after: Duration,
    /// The sends a slow endpoint may have in flight from one process: 2 (at least 1). Its
    /// other deliveries are snoozed, uncounted, until it answers fast again
    /// (docs/webhooks.md, "Delivery semantics").
    pub max_slow_sends: usize,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        Self {
            connect_timeout: Duration::from_secs(5),
            total_timeout: Duration::from_secs(15),
            retry_schedule: DEFAULT_RETRY_SCHEDULE.to_vec(),
            retry_after_bounds: (Duration::from_secs(1), Duration::from_secs(60 * 60)),
            disable_after_failures: 50,
            max_body_bytes: 256 * 1024,
            rotation_overlap: Duration::from_secs(24 * 60 * 60),
            addresses: AddressPolicy::default(),
            idle_per_host: 16,
            max_attempts: outbox_events::DEFAULT_MAX_RETRY_ATTEMPTS,
            slow_after: Duration::from_secs(5),
            max_slow_sends: 2,
        }
    }
}

impl WebhookConfig {
    /// Takes the `MaxRetryAttempts` of the workers that run the deliveries.
    pub fn for_workers(mut self, worker: &outbox_events::WorkerConfig) -> Self {
        self.max_attempts = worker.max_retry_attempts;
        self
    }

    /// Replaces the retry schedule.
    pub fn with_retry_schedule(mut self, schedule: Vec<Duration>) -> Self {
        self.retry_schedule = schedule;
        self
    }

    /// Replaces the address policy.
    pub fn with_addresses(mut self, addresses: AddressPolicy) -> Self {
        self.addresses = addresses;
        self
    }

    /// Replaces the timeouts.
    pub fn with_timeouts(mut self, connect: Duration, total: Duration) -> Self {
        self.connect_timeout = connect;
        self.total_timeout = total;
        self
    }

    /// Replaces what makes an endpoint slow (a send that takes `after`) and how many sends a
    /// slow endpoint may have in flight from one process.
    pub fn with_slow_endpoints(mut self, after: Duration, sends: usize) -> Self {
        self.slow_after = after;
        self.max_slow_sends = sends;
        self
    }

    /// Replaces how long the previous secret still signs after [`crate::Webhooks::rotate`]
    /// (24 h by default).
    pub fn with_rotation_overlap(mut self, overlap: Duration) -> Self {
        self.rotation_overlap = overlap;
        self
    }

    /// Replaces the failures in a row that disable an endpoint.
    pub fn with_disable_after_failures(mut self, failures: i32) -> Self {
        self.disable_after_failures = failures;
        self
    }

    /// The wait after a delivery's `failures`-th failed attempt, jittered by `jitter` in
    /// -1.0..=1.0 (±20% at the ends).
    pub fn retry_wait(&self, failures: i32, jitter: f64) -> Duration {
        let index = usize::try_from(failures.max(1) - 1).unwrap_or(0);
        let base = self
            .retry_schedule
            .get(index)
            .or(self.retry_schedule.last())
            .copied()
            .unwrap_or(Duration::from_secs(5));
        base.mul_f64(1.0 + 0.2 * jitter.clamp(-1.0, 1.0))
    }

    /// A receiver's `Retry-After`, held to [`WebhookConfig::retry_after_bounds`].
    pub fn bounded_retry_after(&self, asked: Duration) -> Duration {
        asked.clamp(self.retry_after_bounds.0, self.retry_after_bounds.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_schedule_spans_hours_and_its_last_wait_repeats() {
        let config = WebhookConfig::default();
        assert_eq!(config.retry_wait(1, 0.0), Duration::from_secs(5));
        assert_eq!(config.retry_wait(8, 0.0), Duration::from_secs(5 * 3600));
        assert_eq!(config.retry_wait(20, 0.0), Duration::from_secs(5 * 3600));
        let total: Duration = (1..=8).map(|f| config.retry_wait(f, 0.0)).sum();
        assert!(total > Duration::from_secs(8 * 3600), "{total:?}");
        assert_eq!(config.retry_wait(2, 1.0), Duration::from_secs(36));
        assert_eq!(config.retry_wait(2, -1.0), Duration::from_secs(24));
    }

    #[test]
    fn retry_after_is_held_to_its_bounds() {
        let config = WebhookConfig::default();
        assert_eq!(
            config.bounded_retry_after(Duration::ZERO),
            Duration::from_secs(1)
        );
        assert_eq!(
            config.bounded_retry_after(Duration::from_secs(86_400)),
            Duration::from_secs(3600)
        );
    }
}
