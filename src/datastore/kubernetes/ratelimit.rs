//! client-go's client-side rate limit, as upstream's (v3.32.1) API clients have it.
//!
//! client-go gives each REST client (one per API group and version) a token bucket
//! (`flowcontrol.NewTokenBucketRateLimiter`, i.e. golang.org/x/time/rate): `burst` tokens,
//! refilled at `qps` a second, full at the start; every request takes one (a retry too),
//! waiting for it when the bucket is empty, and a wait that would end after the request's
//! deadline is refused at once, nothing taken. `rest.Config`'s QPS 0 means 5, Burst 0
//! means 10; a QPS that is not above zero (or is infinite) means no limit.
//!
//! What upstream configures: libcalico-go's Kubernetes datastore client takes QPS from
//! `K8S_CLIENT_QPS` (which the CNI plugin sets from the NetConf's `qps`) and sets Burst to
//! 100 unless `K8S_CLIENT_BURST` (the NetConf's `burst`) says otherwise; the plugin's own
//! client for pods and namespaces keeps client-go's defaults. With QPS above zero, a Burst
//! not above zero is refused when the client is made; a negative Burst otherwise fails
//! every request. One call is one short-lived process with full buckets, and makes about ten
//! requests, so with the defaults no call waits.
//!
//! Here one `RateLimiter` belongs to one `KubeClient` and holds a bucket per API group and
//! version the client talks to, as upstream's clients each hold their own. A request waits
//! for its token before its own timeout starts (as client-go does), never past the call's
//! deadline. The arithmetic (`TokenBucket`) takes the instant as a parameter, for tests.

use std::sync::Mutex;
use std::time::{Duration, Instant};

/// client-go's `DefaultQPS`.
pub const DEFAULT_QPS: f32 = 5.0;
/// client-go's `DefaultBurst`.
pub const DEFAULT_BURST: i64 = 10;
/// The Burst libcalico-go's Kubernetes backend sets unless `K8S_CLIENT_BURST` is given.
pub const CALICO_BURST: i64 = 100;

/// `rest.Config`'s QPS and Burst as configured (zero: client-go's default). The default
/// value is no limit (a library user's client, the installer's, `calico -t`'s); the clients
/// of a plugin call set upstream's (`CLIENT_GO`, `calico`).
#[derive(Clone, Copy, Debug)]
pub struct RateLimit {
    pub qps: f32,
    pub burst: i64,
}

impl Default for RateLimit {
    fn default() -> RateLimit {
        RateLimit::UNLIMITED
    }
}

impl PartialEq for RateLimit {
    fn eq(&self, other: &RateLimit) -> bool {
        self.qps.to_bits() == other.qps.to_bits() && self.burst == other.burst
    }
}

impl Eq for RateLimit {}

impl RateLimit {
    /// client-go's defaults (QPS 5, Burst 10): the plugin's own client for pods and
    /// namespaces.
    pub const CLIENT_GO: RateLimit = RateLimit { qps: 0.0, burst: 0 };
    /// No limit (a QPS below zero, as client-go reads it).
    pub const UNLIMITED: RateLimit = RateLimit {
        qps: -1.0,
        burst: 0,
    };

    /// libcalico-go's datastore client: `qps` (0: client-go's 5), burst 100 unless given.
    pub fn calico(qps: f32, burst: i64) -> RateLimit {
        RateLimit {
            qps,
            burst: if burst != 0 { burst } else { CALICO_BURST },
        }
    }

    /// client-go's refusal of a clientset whose QPS is set and Burst is not.
    pub fn check(&self) -> Result<(), String> {
        if self.qps > 0.0 && self.burst <= 0 {
            return Err("burst is required to be greater than 0 when RateLimiter is not set and QPS is set to greater than 0".into());
        }
        Ok(())
    }

    /// The bucket's rate and size (`RESTClientFor`'s defaults applied), or `None` for no
    /// limit.
    pub fn effective(&self) -> Option<(f64, i64)> {
        let qps = if self.qps == 0.0 {
            DEFAULT_QPS
        } else {
            self.qps
        };
        let burst = if self.burst == 0 {
            DEFAULT_BURST
        } else {
            self.burst
        };
        (qps > 0.0 && qps.is_finite()).then_some((f64::from(qps), burst))
    }
}

/// Why a request got no token.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The bucket can never hold one token (a negative burst).
    #[error(
        "client rate limiter Wait returned an error: rate: Wait(n=1) exceeds limiter's burst {0}"
    )]
    OverBurst(i64),
    /// The token would come after the deadline.
    #[error(
        "client rate limiter Wait returned an error: rate: Wait(n=1) would exceed context deadline"
    )]
    PastDeadline,
}

/// golang.org/x/time/rate's `Limiter` for one token at a time: full at first; a reservation
/// may take the count below zero, so waiters are served in order, each `1/qps` apart.
#[derive(Clone, Debug)]
pub struct TokenBucket {
    qps: f64,
    burst: i64,
    tokens: f64,
    last: Option<Instant>,
}

impl TokenBucket {
    pub fn new(qps: f64, burst: i64) -> TokenBucket {
        TokenBucket {
            qps,
            burst,
            tokens: burst as f64,
            last: None,
        }
    }

    /// The tokens there are at `now` (refilled since the last reservation, at most `burst`).
    fn advance(&self, now: Instant) -> f64 {
        let last = match self.last {
            Some(l) if l <= now => l,
            _ => now,
        };
        let refilled = self.tokens + now.duration_since(last).as_secs_f64() * self.qps;
        refilled.min(self.burst as f64)
    }

    /// Takes a token at `now`: the wait before it may be used, or a refusal when the wait
    /// would end after `limit` (then nothing is taken).
    pub fn reserve(&mut self, now: Instant, limit: Option<Instant>) -> Result<Duration, Refused> {
        if self.burst < 1 {
            return Err(Refused::OverBurst(self.burst));
        }
        let tokens = self.advance(now) - 1.0;
        let wait = if tokens < 0.0 {
            Duration::try_from_secs_f64(-tokens / self.qps).unwrap_or(Duration::MAX)
        } else {
            Duration::ZERO
        };
        if let Some(limit) = limit {
            if now.checked_add(wait).is_none_or(|at| at > limit) {
                return Err(Refused::PastDeadline);
            }
        }
        self.last = Some(now);
        self.tokens = tokens;
        Ok(wait)
    }
}

/// The buckets of one API client, one per API group and version, made on first use.
#[derive(Debug)]
pub struct RateLimiter {
    bucket: Option<(f64, i64)>,
    buckets: Mutex<Vec<(String, TokenBucket)>>,
}

/// The API group and version a request path belongs to (`/api/v1`, `/apis/<group>/<v>`),
/// which names client-go's REST client for it.
pub fn group_version(path: &str) -> &str {
    let path = path.split('?').next().unwrap_or(path);
    let segments = match path.split('/').nth(1) {
        Some("api") => 2,
        Some("apis") => 3,
        _ => 1,
    };
    let end = path
        .match_indices('/')
        .nth(segments)
        .map(|(i, _)| i)
        .unwrap_or(path.len());
    &path[..end]
}

impl RateLimiter {
    pub fn new(rate: RateLimit) -> RateLimiter {
        RateLimiter {
            bucket: rate.effective(),
            buckets: Mutex::new(Vec::new()),
        }
    }

    /// Takes a token for a request to `path` at `now`: the wait before sending it, or the
    /// refusal (`TokenBucket::reserve`).
    pub fn reserve(
        &self,
        path: &str,
        now: Instant,
        limit: Option<Instant>,
    ) -> Result<Duration, Refused> {
        let Some((qps, burst)) = self.bucket else {
            return Ok(Duration::ZERO);
        };
        let key = group_version(path);
        let Ok(mut buckets) = self.buckets.lock() else {
            // A thread panicked while holding it: no limit rather than no requests.
            return Ok(Duration::ZERO);
        };
        if let Some((_, b)) = buckets.iter_mut().find(|(k, _)| k == key) {
            return b.reserve(now, limit);
        }
        let mut b = TokenBucket::new(qps, burst);
        let wait = b.reserve(now, limit);
        buckets.push((key.to_string(), b));
        wait
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_full_bucket_then_one_token_per_interval() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(5.0, 3);
        // Three at once, then each 200 ms after the one before, reserved ahead in order.
        for _ in 0..3 {
            assert_eq!(b.reserve(t0, None), Ok(Duration::ZERO));
        }
        assert_eq!(b.reserve(t0, None), Ok(200 * MS));
        assert_eq!(b.reserve(t0, None), Ok(400 * MS));
        // 1 s later the two reserved tokens are paid back and three more have come.
        let t1 = t0 + 1000 * MS;
        for _ in 0..3 {
            assert_eq!(b.reserve(t1, None), Ok(Duration::ZERO));
        }
        assert_eq!(b.reserve(t1, None), Ok(200 * MS));
        // A long pause refills only up to the burst.
        let t2 = t1 + Duration::from_secs(3600);
        for _ in 0..3 {
            assert_eq!(b.reserve(t2, None), Ok(Duration::ZERO));
        }
        assert_eq!(b.reserve(t2, None), Ok(200 * MS));
    }

    #[test]
    fn a_wait_past_the_deadline_is_refused_and_takes_nothing() {
        let t0 = Instant::now();
        let mut b = TokenBucket::new(1.0, 1);
        assert_eq!(b.reserve(t0, Some(t0)), Ok(Duration::ZERO));
        // The next token comes at t0 + 1 s: refused with half a second left ...
        assert_eq!(
            b.reserve(t0, Some(t0 + 500 * MS)),
            Err(Refused::PastDeadline)
        );
        // ... so it is still there for one that can wait for it, exactly to its limit.
        assert_eq!(
            b.reserve(t0, Some(t0 + 1000 * MS)),
            Ok(Duration::from_secs(1))
        );
        assert_eq!(b.reserve(t0, None), Ok(Duration::from_secs(2)));
    }

    #[test]
    fn upstream_defaults_and_odd_settings() {
        // The plugin's own client: client-go's 5 and 10.
        assert_eq!(RateLimit::CLIENT_GO.effective(), Some((5.0, 10)));
        assert_eq!(RateLimit::default().effective(), None);
        // libcalico-go's datastore client: 5 and 100, or what K8S_CLIENT_* say.
        assert_eq!(RateLimit::calico(0.0, 0).effective(), Some((5.0, 100)));
        assert_eq!(RateLimit::calico(20.0, 0).effective(), Some((20.0, 100)));
        assert_eq!(RateLimit::calico(0.0, 7).effective(), Some((5.0, 7)));
        // No limit: a QPS below zero, NaN or infinite.
        assert_eq!(RateLimit::calico(-1.0, 0).effective(), None);
        assert_eq!(RateLimit::calico(f32::NAN, 0).effective(), None);
        assert_eq!(RateLimit::calico(f32::INFINITY, 0).effective(), None);
        // A QPS with a Burst below one is refused when the client is made...
        assert!(RateLimit::calico(5.0, -1).check().is_err());
        assert!(RateLimit::calico(5.0, 0).check().is_ok());
        // ... and without a QPS, every request is.
        let l = RateLimiter::new(RateLimit::calico(0.0, -2));
        assert_eq!(
            l.reserve("/api/v1/pods", Instant::now(), None),
            Err(Refused::OverBurst(-2))
        );
        let unlimited = RateLimiter::new(RateLimit::calico(-1.0, 1));
        for _ in 0..1000 {
            assert_eq!(
                unlimited.reserve("/api/v1/pods", Instant::now(), None),
                Ok(Duration::ZERO)
            );
        }
    }

    #[test]
    fn one_bucket_per_api_group_and_version() {
        assert_eq!(group_version("/api/v1/namespaces/a/pods/b"), "/api/v1");
        assert_eq!(group_version("/api/v1"), "/api/v1");
        assert_eq!(
            group_version("/apis/crd.projectcalico.org/v1/ipamblocks/x?resourceVersion=0"),
            "/apis/crd.projectcalico.org/v1"
        );
        assert_eq!(
            group_version("/apis/projectcalico.org"),
            "/apis/projectcalico.org"
        );
        assert_eq!(group_version("/version"), "/version");
        let t0 = Instant::now();
        let l = RateLimiter::new(RateLimit { qps: 1.0, burst: 1 });
        assert_eq!(l.reserve("/api/v1/nodes/n", t0, None), Ok(Duration::ZERO));
        assert_eq!(
            l.reserve("/apis/crd.projectcalico.org/v1/ippools", t0, None),
            Ok(Duration::ZERO)
        );
        assert_eq!(
            l.reserve("/api/v1/namespaces/a", t0, None),
            Ok(Duration::from_secs(1))
        );
    }
}
