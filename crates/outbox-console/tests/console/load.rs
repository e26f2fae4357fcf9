//! The console's load on the database (issue 40): however many tabs poll the overview, the
//! server sees one set of overview reads per `OVERVIEW_REFRESH`. Counted from PostgreSQL's own
//! statistics (`pg_stat_database`: the transactions of the test's database), flushed by
//! closing the console's pool before they are read.

use std::time::{Duration, Instant};

use outbox_console::{Console, ConsoleConfig, OVERVIEW_REFRESH};
use outbox_persistence::Database;
use outbox_tests::TestDb;

use crate::net::*;

/// The transactions PostgreSQL has counted for this database.
async fn transactions(db: &TestDb) -> i64 {
    db.count(
        "SELECT (xact_commit + xact_rollback)::bigint FROM pg_stat_database \
         WHERE datname = current_database()",
    )
    .await
}

/// Serves a console on a pool of its own while `pollers` clients each ask for the overview's
/// live part every 100 ms for `span`; returns the transactions the server counted meanwhile
/// and the answers given.
async fn polled(db: &TestDb, pollers: usize, span: Duration) -> (i64, usize) {
    // A backend's statistics reach pg_stat_database when it exits (or within seconds): the
    // test's own connections are idle, and the console's pool is closed before counting.
    tokio::time::sleep(Duration::from_millis(1200)).await;
    let before = transactions(db).await;
    let pool = Database::connect(&db.url, Default::default())
        .await
        .expect("a pool of the console's own");
    let console = Console::new(pool.clone(), Vec::new(), ConsoleConfig::default()).unwrap();
    let served = Served::start(console).await;
    let mut clients = tokio::task::JoinSet::new();
    for _ in 0..pollers {
        let addr = served.addr;
        clients.spawn(async move {
            let (until, mut answered) = (Instant::now() + span, 0);
            while Instant::now() < until {
                let page = raw_get(addr, "/fragments/overview", &[]).await;
                assert_eq!(page.status, 200, "{}", page.text());
                answered += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            answered
        });
    }
    let mut answered = 0;
    while let Some(n) = clients.join_next().await {
        answered += n.expect("a poller");
    }
    drop(served);
    pool.close().await;
    tokio::time::sleep(Duration::from_millis(1200)).await;
    (transactions(db).await - before, answered)
}

async fn many_tabs_cost_one_set_of_reads_per_refresh() {
    let Some(db) = TestDb::postgres().await else {
        return;
    };
    // One tab and sixteen, each for the same span on a pool of its own: the same reads.
    let span = OVERVIEW_REFRESH * 3;
    let (one, one_answered) = polled(&db, 1, span).await;
    let (sixteen, answered) = polled(&db, 16, span).await;
    eprintln!(
        "overview load over {span:?}: 1 poller {one_answered} answers for {one} transactions; 16 pollers {answered} answers for {sixteen} transactions"
    );
    assert!(answered >= 16 * 10, "the pollers polled: {answered}");
    // A set is several transactions (the counts, the chart, the blocked keys, the paused
    // types): one set more than the single tab's run (a refresh falling either side of the
    // span's end) is the most the sixteen may cost.
    let set = (one / 4).max(6);
    assert!(
        sixteen <= one + set,
        "{sixteen} transactions for {answered} answers, against {one} for one tab: more than one set of reads per refresh"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_many_tabs_cost_one_set_of_reads_per_refresh() {
    many_tabs_cost_one_set_of_reads_per_refresh().await;
}
