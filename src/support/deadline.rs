//! One deadline per plugin call, measured from process start, that every wait respects:
//! datastore requests, the IPAM lock, netlink waits and child plugins.
//!
//! * The budget is `DEFAULT_BUDGET` (30 s), or the NetConf's `call_timeout_seconds`, or the
//!   environment's `CALICO_CALL_TIMEOUT_SECONDS` (the environment wins; 0, or a value that
//!   is not a whole number of seconds, counts as unset; more than `MAX_BUDGET` is cut). 30 s is well under kubelet's 2 min runtime-request timeout
//!   and containerd's 4 min sandbox-setup timeout, and both retry a failed call.
//! * Work on the call's main path is bounded by the deadline itself (`bound`, `remaining`,
//!   `check`). Undoing a half-made pod after a failure runs under `cleanup_bound`, which may
//!   go on for `GRACE` past the deadline: a call never runs longer than budget + grace.
//! * Nothing is bounded until `arm` is called: only the CNI entry point arms it, so library
//!   users (tests, `calico -t`, `calico-ipam -upgrade`) keep their own timeouts.
//!
//! The clock is a process-wide start `Instant`; the arithmetic lives in `Deadline`, a plain
//! value with explicit instants for unit tests. Inside `cleanup_bound` the limit is carried
//! by a tokio task-local, so every datastore request made by the undo (on this task) sees
//! the extended limit; code on other threads computes its bound before it leaves the task.

use std::future::Future;
use std::sync::RwLock;
use std::time::{Duration, Instant};

/// The budget of a call when nothing configures one.
pub const DEFAULT_BUDGET: Duration = Duration::from_secs(30);
/// The longest budget accepted (far beyond any runtime's own timeout).
pub const MAX_BUDGET: Duration = Duration::from_secs(3600);
/// How long the undo of a failed call may run past the deadline.
pub const GRACE: Duration = Duration::from_secs(3);
/// The environment variable that overrides `call_timeout_seconds`.
pub const ENV: &str = "CALICO_CALL_TIMEOUT_SECONDS";
/// How long past the cleanup limit the watchdog lets a stuck call run.
pub const WATCHDOG_MARGIN: Duration = Duration::from_secs(1);

/// A call's deadline: `start + budget`, and the cleanup limit `start + budget + GRACE`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Deadline {
    pub start: Instant,
    pub budget: Duration,
}

impl Deadline {
    pub fn new(start: Instant, budget: Duration) -> Deadline {
        Deadline { start, budget }
    }

    /// When the call's own work must be done.
    pub fn at(&self) -> Instant {
        self.start + self.budget
    }

    /// When the undo of a failed call must be done.
    pub fn cleanup_at(&self) -> Instant {
        self.at() + GRACE
    }
}

/// The call ran out of time. Its text names the budget, where it comes from and what the
/// call was waiting for.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("calico: the call took longer than its deadline of {}s ({source_name}) while {what}", budget.as_secs())]
pub struct Expired {
    pub budget: Duration,
    /// `call_timeout_seconds`, or the environment variable when that set it.
    pub source_name: &'static str,
    pub what: String,
}

/// Where the budget came from (named in the error).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BudgetSource {
    Default,
    NetConf,
    Env,
}

impl BudgetSource {
    fn name(self) -> &'static str {
        match self {
            BudgetSource::Env => ENV,
            BudgetSource::Default | BudgetSource::NetConf => "call_timeout_seconds",
        }
    }
}

struct State {
    deadline: Deadline,
    source: BudgetSource,
}

static STATE: RwLock<Option<State>> = RwLock::new(None);

tokio::task_local! {
    /// The limit inside `cleanup_bound` (the deadline plus the grace).
    static SCOPE_LIMIT: Instant;
}

/// Starts the call's clock (at process start) with the default budget. Only the CNI entry
/// point calls this; until then nothing is bounded.
pub fn arm(start: Instant) {
    if let Ok(mut s) = STATE.write() {
        *s = Some(State {
            deadline: Deadline::new(start, DEFAULT_BUDGET),
            source: BudgetSource::Default,
        });
    }
}

/// Sets the budget from the NetConf's `call_timeout_seconds` and the environment (which
/// wins). Does nothing unless armed.
pub fn configure(conf_seconds: i64) {
    let env = std::env::var(ENV).ok();
    let (budget, source, warning) = resolve_budget(env.as_deref(), conf_seconds);
    if let Some(w) = warning {
        tracing::warn!("{w}");
    }
    if let Ok(mut s) = STATE.write() {
        if let Some(state) = s.as_mut() {
            state.deadline.budget = budget;
            state.source = source;
            tracing::debug!(?budget, "call deadline");
        }
    }
}

/// Adds `extra` to the call's budget (at most `MAX_BUDGET` in all), for the waits its
/// configuration asks for on top of its own work (ADD's readiness gates and
/// `policy_setup_timeout_seconds`): a configured wait is never cut short by the deadline.
/// Does nothing unless armed.
pub fn extend(extra: Duration) {
    if extra.is_zero() {
        return;
    }
    if let Ok(mut s) = STATE.write() {
        if let Some(state) = s.as_mut() {
            let budget = state.deadline.budget.saturating_add(extra).min(MAX_BUDGET);
            tracing::debug!(
                ?budget,
                ?extra,
                "call deadline extended for configured waits"
            );
            state.deadline.budget = budget;
        }
    }
}

/// The budget from the environment's value (if any) and the NetConf's, with a warning to
/// log for a value that cannot be used. 0 in either place means "not set".
pub fn resolve_budget(
    env: Option<&str>,
    conf_seconds: i64,
) -> (Duration, BudgetSource, Option<String>) {
    let (budget, source, warning) = resolve_unclamped(env, conf_seconds);
    if budget > MAX_BUDGET {
        let w = format!(
            "call deadline of {}s cut to {}s",
            budget.as_secs(),
            MAX_BUDGET.as_secs()
        );
        return (MAX_BUDGET, source, Some(w));
    }
    (budget, source, warning)
}

fn resolve_unclamped(
    env: Option<&str>,
    conf_seconds: i64,
) -> (Duration, BudgetSource, Option<String>) {
    let mut warning = None;
    if let Some(raw) = env.map(str::trim).filter(|v| !v.is_empty()) {
        match raw.parse::<u64>() {
            Ok(0) => {}
            Ok(secs) => return (Duration::from_secs(secs), BudgetSource::Env, None),
            Err(_) => {
                warning = Some(format!(
                    "ignoring {ENV}={raw:?}: not a whole number of seconds"
                ))
            }
        }
    }
    match u64::try_from(conf_seconds) {
        Ok(0) => (DEFAULT_BUDGET, BudgetSource::Default, warning),
        Ok(secs) => (Duration::from_secs(secs), BudgetSource::NetConf, warning),
        Err(_) => (
            DEFAULT_BUDGET,
            BudgetSource::Default,
            Some(format!(
                "ignoring call_timeout_seconds {conf_seconds}: it must not be negative; using {}s",
                DEFAULT_BUDGET.as_secs()
            )),
        ),
    }
}

fn state() -> Option<(Deadline, BudgetSource)> {
    STATE
        .read()
        .ok()
        .and_then(|s| s.as_ref().map(|s| (s.deadline, s.source)))
}

/// The call's deadline, if armed.
pub fn current() -> Option<Deadline> {
    state().map(|(d, _)| d)
}

/// The instant the current work must be done by: the deadline, or inside `cleanup_bound`
/// the deadline plus the grace. `None` when not armed.
pub fn limit() -> Option<Instant> {
    SCOPE_LIMIT
        .try_with(|l| *l)
        .ok()
        .or_else(|| current().map(|d| d.at()))
}

/// Time left until `limit()` (`Duration::MAX` when not armed).
pub fn remaining() -> Duration {
    match limit() {
        Some(l) => l.saturating_duration_since(Instant::now()),
        None => Duration::MAX,
    }
}

/// `min(timeout, remaining())`, and whether the deadline is what bounds it (then running
/// out of the returned time means the call expired, not the request).
pub fn cap(timeout: Duration) -> (Duration, bool) {
    let left = remaining();
    if left < timeout {
        (left, true)
    } else {
        (timeout, false)
    }
}

/// `cap` as the instant a wait must end by: `now + timeout`, or the limit itself when that
/// comes first, and whether the limit is what bounds it. Waits nested in one another that
/// the deadline cuts then all end at the same instant, and the innermost one, which names
/// what the call was waiting for, is the one that reports it: a tokio timeout polls what it
/// wraps before its own timer. With `cap`'s durations each wait ended a little past the
/// limit, by however long the thread took between reading the clock and arming its timer,
/// so on a busy machine an outer wait could fire first and report only its own step.
pub fn cap_at(timeout: Duration) -> (tokio::time::Instant, bool) {
    let own = Instant::now().checked_add(timeout);
    match (limit(), own) {
        (Some(l), Some(o)) if o < l => (o.into(), false),
        (Some(l), _) => (l.into(), true),
        (None, Some(o)) => (o.into(), false),
        // Unbounded: as far off as tokio's own "never".
        (None, None) => (
            tokio::time::Instant::now() + Duration::from_secs(86400 * 365 * 30),
            false,
        ),
    }
}

/// The error for running out of time while `what` ("waiting for etcd (get /calico/…)").
pub fn expired(what: impl Into<String>) -> Expired {
    let e = unlogged_expired(what.into());
    tracing::warn!("{e}");
    e
}

fn unlogged_expired(what: String) -> Expired {
    let (budget, source) = state()
        .map(|(d, s)| (d.budget, s))
        .unwrap_or((DEFAULT_BUDGET, BudgetSource::Default));
    Expired {
        budget,
        source_name: source.name(),
        what,
    }
}

/// The last resort, for a wait that somehow ignores the deadline (a kernel call that never
/// returns, a bug): a thread that hands the error to `on_expiry`, which must end the
/// process, once the cleanup limit plus `WATCHDOG_MARGIN` has passed. Nothing is undone
/// then; everything else ends well before.
pub fn spawn_watchdog(on_expiry: impl FnOnce(Expired) + Send + 'static) {
    if let Err(e) = std::thread::Builder::new()
        .name("calico-deadline".into())
        .spawn(move || watch(current, on_expiry))
    {
        tracing::warn!(error = %e, "cannot start the deadline watchdog");
    }
}

/// The watchdog's loop, over the deadline `deadline()` gives (none: nothing to watch).
fn watch(deadline: impl Fn() -> Option<Deadline>, on_expiry: impl FnOnce(Expired)) {
    loop {
        let Some(d) = deadline() else { return };
        let hard_stop = d.cleanup_at() + WATCHDOG_MARGIN;
        let now = Instant::now();
        if now >= hard_stop {
            // Not logged: the stuck thread may hold the log writer.
            on_expiry(unlogged_expired("finishing the call".into()));
            return;
        }
        // Then look again: `configure` may have moved the deadline meanwhile.
        std::thread::sleep(hard_stop - now);
    }
}

/// `Err` once the current limit has passed: a request is not even started then.
pub fn check(what: impl Into<String>) -> Result<(), Expired> {
    match limit() {
        Some(l) if Instant::now() >= l => Err(expired(what)),
        _ => Ok(()),
    }
}

/// Runs `fut` until the current limit.
pub async fn bound<F: Future>(what: &str, fut: F) -> Result<F::Output, Expired> {
    match limit() {
        None => Ok(fut.await),
        Some(l) => tokio::time::timeout_at(l.into(), fut)
            .await
            .map_err(|_| expired(what)),
    }
}

/// Runs the undo of a failed call: `fut` may go on until the deadline plus `GRACE` (also
/// when the call failed early: the total bound of a call is its budget plus the grace), and
/// every bounded wait inside it sees that limit.
pub async fn cleanup_bound<F: Future>(what: &str, fut: F) -> Result<F::Output, Expired> {
    cleanup_bound_with(current(), what, fut).await
}

async fn cleanup_bound_with<F: Future>(
    deadline: Option<Deadline>,
    what: &str,
    fut: F,
) -> Result<F::Output, Expired> {
    match deadline {
        None => Ok(fut.await),
        Some(d) => scoped(d.cleanup_at(), bound(what, fut)).await,
    }
}

/// Runs `fut` with `limit` as the limit every bounded wait inside it sees.
async fn scoped<F: Future>(limit: Instant, fut: F) -> F::Output {
    SCOPE_LIMIT.scope(limit, fut).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn remaining_and_limits_from_explicit_instants() {
        let t0 = Instant::now();
        let d = Deadline::new(t0, Duration::from_secs(30));
        assert_eq!(d.at(), t0 + Duration::from_secs(30));
        assert_eq!(d.cleanup_at(), t0 + Duration::from_secs(33));
    }

    #[test]
    fn budget_resolution() {
        let secs = |s| Duration::from_secs(s);
        assert_eq!(
            resolve_budget(None, 0),
            (DEFAULT_BUDGET, BudgetSource::Default, None)
        );
        assert_eq!(
            resolve_budget(None, 7),
            (secs(7), BudgetSource::NetConf, None)
        );
        // The environment wins.
        assert_eq!(
            resolve_budget(Some("5"), 7),
            (secs(5), BudgetSource::Env, None)
        );
        assert_eq!(
            resolve_budget(Some(" 5 "), 0),
            (secs(5), BudgetSource::Env, None)
        );
        // 0 or empty: not set.
        assert_eq!(
            resolve_budget(Some("0"), 7),
            (secs(7), BudgetSource::NetConf, None)
        );
        assert_eq!(
            resolve_budget(Some(""), 0),
            (DEFAULT_BUDGET, BudgetSource::Default, None)
        );
        // Unusable values: the next source, with a warning.
        for bad in ["-3", "1.5", "ten"] {
            let (b, s, w) = resolve_budget(Some(bad), 0);
            assert_eq!((b, s), (DEFAULT_BUDGET, BudgetSource::Default));
            assert!(w.unwrap().contains(ENV), "{bad}");
        }
        let (b, s, w) = resolve_budget(Some("x"), 4);
        assert_eq!((b, s), (secs(4), BudgetSource::NetConf));
        assert!(w.is_some());
        let (b, s, w) = resolve_budget(None, -1);
        assert_eq!((b, s), (DEFAULT_BUDGET, BudgetSource::Default));
        assert!(w.unwrap().contains("must not be negative"));
        // Huge values are cut (an Instant cannot be pushed past its range).
        let (b, s, w) = resolve_budget(Some("18446744073709551615"), i64::MAX);
        assert_eq!((b, s), (MAX_BUDGET, BudgetSource::Env));
        assert!(w.unwrap().contains("cut to 3600s"));
        let (b, s, _) = resolve_budget(None, i64::MAX);
        assert_eq!((b, s), (MAX_BUDGET, BudgetSource::NetConf));
    }

    #[test]
    fn the_error_names_budget_source_and_step() {
        let e = Expired {
            budget: Duration::from_secs(30),
            source_name: "call_timeout_seconds",
            what: "waiting for etcd (get /calico/ipam/v2/config)".into(),
        };
        assert_eq!(
            e.to_string(),
            "calico: the call took longer than its deadline of 30s (call_timeout_seconds) while waiting for etcd (get /calico/ipam/v2/config)"
        );
    }

    fn runtime() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    /// Bounded waits, on limits set for one task only (the process-wide clock stays unarmed,
    /// so other tests running alongside are not bounded).
    #[test]
    fn waits_are_cut_at_the_limit() {
        runtime().block_on(async {
            // Unarmed: nothing is bounded.
            assert_eq!(remaining(), Duration::MAX);
            assert_eq!(bound("x", async { 1 }).await, Ok(1));
            assert!(check("x").is_ok());
            assert_eq!(cap(Duration::from_secs(5)), (Duration::from_secs(5), false));

            // Past the limit: a request is refused at once, a wait ends at once.
            let past = Instant::now() - Duration::from_millis(1);
            scoped(past, async {
                assert_eq!(remaining(), Duration::ZERO);
                assert_eq!(cap(Duration::from_secs(5)), (Duration::ZERO, true));
                let e = check("waiting for etcd (get /k)").unwrap_err();
                assert_eq!(e.what, "waiting for etcd (get /k)");
                let started = Instant::now();
                let r = bound("sleeping", tokio::time::sleep(Duration::from_secs(10))).await;
                assert_eq!(r.unwrap_err().what, "sleeping");
                assert!(started.elapsed() < Duration::from_millis(500));
            })
            .await;

            // Before the limit: waits are capped by what is left.
            let soon = Instant::now() + Duration::from_millis(300);
            scoped(soon, async {
                let (left, capped) = cap(Duration::from_secs(10));
                assert!(capped && left <= Duration::from_millis(300));
                assert_eq!(
                    cap(Duration::from_millis(1)),
                    (Duration::from_millis(1), false)
                );
                assert_eq!(bound("x", async { 2 }).await, Ok(2));
                let started = Instant::now();
                let r = bound("sleeping", tokio::time::sleep(Duration::from_secs(10))).await;
                assert!(r.is_err());
                let took = started.elapsed();
                assert!(took < Duration::from_secs(2), "{took:?}");
            })
            .await;
        });
    }

    /// Waits cut by the deadline end at its very instant, so when one is nested in another
    /// the inner one, which names what the call waited for, reports the expiry.
    #[test]
    fn nested_waits_cut_by_the_deadline_report_the_innermost() {
        runtime().block_on(async {
            for _ in 0..5 {
                let soon = Instant::now() + Duration::from_millis(40);
                scoped(soon, async {
                    let (at, capped) = cap_at(Duration::from_secs(10));
                    assert!(capped);
                    assert_eq!(at, soon.into());
                    let (short, capped) = cap_at(Duration::from_millis(1));
                    assert!(!capped && short < soon.into());
                    let outer = tokio::time::timeout_at(cap_at(Duration::from_secs(90)).0, async {
                        // The inner wait is armed later than the outer one, as a request
                        // inside the IPAM work is.
                        tokio::task::yield_now().await;
                        std::thread::sleep(Duration::from_millis(3));
                        let (at, _) = cap_at(Duration::from_secs(5));
                        tokio::time::timeout_at(at, std::future::pending::<()>()).await
                    })
                    .await;
                    assert!(matches!(outer, Ok(Err(_))), "the outer wait fired first");
                })
                .await;
            }
        });
    }

    /// The undo of a failed call gets the grace past the deadline, and nothing more.
    #[test]
    fn the_undo_gets_the_grace() {
        runtime().block_on(async {
            let budget = Duration::from_secs(1);
            // The deadline passed a second ago: the undo still has about GRACE - 1 s.
            let d = Deadline::new(Instant::now() - budget - Duration::from_secs(1), budget);
            let inner = cleanup_bound_with(Some(d), "undoing", async {
                let (left, capped) = cap(Duration::from_secs(10));
                assert!(capped && left > Duration::from_secs(1) && left < GRACE);
                check("a request during the undo")
            })
            .await;
            assert_eq!(inner, Ok(Ok(())));
            // An undo that would outlive the grace is cut at deadline + GRACE.
            let d = Deadline::new(
                Instant::now() - budget - GRACE + Duration::from_millis(200),
                budget,
            );
            let started = Instant::now();
            let cut = cleanup_bound_with(
                Some(d),
                "undoing",
                tokio::time::sleep(Duration::from_secs(10)),
            )
            .await;
            assert_eq!(cut.unwrap_err().what, "undoing");
            assert!(started.elapsed() < Duration::from_secs(2));
            // Unarmed, an undo is not bounded.
            assert_eq!(cleanup_bound_with(None, "x", async { 3 }).await, Ok(3));
        });
    }

    #[test]
    fn the_watchdog_fires_after_deadline_grace_and_margin() {
        // Unarmed: it returns without firing.
        watch(|| None, |_| panic!("fired without a deadline"));
        // A deadline whose hard stop is 200 ms away: it fires then, once.
        let budget = Duration::from_secs(1);
        let start = Instant::now() - budget - GRACE - WATCHDOG_MARGIN + Duration::from_millis(200);
        let d = Deadline::new(start, budget);
        let began = Instant::now();
        let mut fired = Vec::new();
        watch(|| Some(d), |e| fired.push(e.what));
        assert_eq!(fired, ["finishing the call"]);
        let took = began.elapsed();
        assert!(
            took >= Duration::from_millis(150) && took < Duration::from_secs(2),
            "{took:?}"
        );
    }
}
