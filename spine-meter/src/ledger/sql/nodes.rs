//! Operators, nodes and one-time enrollment tokens, once for both stores.

use spine_core::{NodeId, OperatorId};

use super::{
    finish, insert, insert_owned, read_text, retrying, unique_as, Arg, Backend, SqlConn, SqlRow,
    TxEnd as _,
};
use crate::ledger::convert::{db, now_ms, to_u64};
use crate::ledger::{Enrollment, LedgerError, NodeRecord};

/// [`Store::create_operator`](crate::ledger::Store::create_operator).
pub(in crate::ledger) async fn create_operator<B: Backend>(
    b: &B,
    operator: &OperatorId,
) -> Result<(), LedgerError> {
    insert(
        b,
        "INSERT INTO operators (id, created_at_ms) VALUES ($1, $2)",
        &[Arg::Text(operator.as_str()), Arg::I64(now_ms())],
        "operator",
    )
    .await?;
    Ok(())
}

/// [`Store::operator_earned_micros`](crate::ledger::Store::operator_earned_micros).
pub(in crate::ledger) async fn operator_earned_micros<B: Backend>(
    b: &B,
    operator: &OperatorId,
) -> Result<u64, LedgerError> {
    let row = b
        .read()
        .await?
        .optional(
            "SELECT earned_micros FROM operators WHERE id = $1",
            &[Arg::Text(operator.as_str())],
        )
        .await?
        .ok_or_else(|| LedgerError::UnknownOperator(operator.clone()))?;
    row.u64("earned_micros")
}

/// Inserts a node of `operator`; the id is `node_<n>`, `n` counting registrations (under
/// [`Backend::NODES_LOCK`], one registration at a time; reads are not blocked).
async fn insert_node<B: Backend>(
    c: &mut B::Tx,
    operator: &OperatorId,
    public_key_text: &str,
    name: Option<&str>,
) -> Result<NodeId, LedgerError> {
    if let Some(lock) = B::NODES_LOCK {
        c.exec(lock, &[]).await?;
    }
    let exists = c
        .optional(
            "SELECT 1 FROM operators WHERE id = $1",
            &[Arg::Text(operator.as_str())],
        )
        .await?;
    if exists.is_none() {
        return Err(LedgerError::UnknownOperator(operator.clone()));
    }
    let n = c
        .optional("SELECT COUNT(*) + 1 AS n FROM nodes", &[])
        .await?
        .map_or(Ok(1), |row| row.i64("n"))?;
    let node = NodeId::new(format!("node_{n}"));
    c.exec(
        "INSERT INTO nodes (node_id, operator_id, public_key_text, name, created_at_ms) VALUES ($1, $2, $3, $4, $5)",
        &[
            Arg::Text(node.as_str()),
            Arg::Text(operator.as_str()),
            Arg::Text(public_key_text),
            Arg::OptText(name),
            Arg::I64(now_ms()),
        ],
    )
    .await
    .map_err(|e| unique_as(e, "node public key"))?;
    Ok(node)
}

/// [`Store::register_node`](crate::ledger::Store::register_node).
pub(in crate::ledger) async fn register_node<B: Backend>(
    b: &B,
    operator: &OperatorId,
    public_key_text: &str,
) -> Result<NodeId, LedgerError> {
    retrying::<B, _, _, _>(|| async {
        let mut tx = b.begin().await?;
        let inserted = insert_node::<B>(&mut tx, operator, public_key_text, None).await;
        finish::<B>(tx, inserted.is_ok()).await?;
        inserted
    })
    .await
}

/// [`Store::create_enrollment`](crate::ledger::Store::create_enrollment).
pub(in crate::ledger) async fn create_enrollment<B: Backend>(
    b: &B,
    operator: &OperatorId,
    token_hash: &str,
    expires_at_ms: i64,
) -> Result<(), LedgerError> {
    insert_owned(
        b,
        "INSERT INTO enrollments (token_hash, operator_id, expires_at_ms, created_at_ms)
         SELECT $1, id, $3, $4 FROM operators WHERE id = $2",
        &[
            Arg::Text(token_hash),
            Arg::Text(operator.as_str()),
            Arg::I64(expires_at_ms),
            Arg::I64(now_ms()),
        ],
        "enrollment token",
        || LedgerError::UnknownOperator(operator.clone()),
    )
    .await
}

/// [`Store::redeem_enrollment`](crate::ledger::Store::redeem_enrollment).
pub(in crate::ledger) async fn redeem_enrollment<B: Backend>(
    b: &B,
    token_hash: &str,
    public_key_text: &str,
    name: Option<&str>,
) -> Result<Enrollment, LedgerError> {
    // Anyone who reaches the tunnel listener may redeem: a token that was never issued is
    // refused on a read, and never waits for (nor holds) the write transaction that billing
    // shares (SQLite's one writer, a PostgreSQL connection for three round trips).
    let issued = read_text(
        b,
        "SELECT operator_id FROM enrollments WHERE token_hash = $1",
        &[Arg::Text(token_hash)],
        "operator_id",
    )
    .await?;
    if issued.is_none() {
        return Err(LedgerError::UnknownEnrollment);
    }
    retrying::<B, _, _, _>(|| async {
        let mut tx = b.begin().await?;
        match redeem_in::<B>(&mut tx, token_hash, public_key_text, name).await {
            Ok((enrollment, write)) => {
                finish::<B>(tx, write).await?;
                Ok(enrollment)
            }
            Err(e) => {
                tx.rollback().await.map_err(db)?;
                Err(e)
            }
        }
    })
    .await
}

/// The body of [`redeem_enrollment`]: the enrollment row is read with [`Backend::FOR_UPDATE`],
/// so two redemptions of one token queue and the second sees the first. Returns the
/// enrollment and whether anything was written (to commit).
async fn redeem_in<B: Backend>(
    c: &mut B::Tx,
    token_hash: &str,
    public_key_text: &str,
    name: Option<&str>,
) -> Result<(Enrollment, bool), LedgerError> {
    let sql = format!(
        "SELECT operator_id, expires_at_ms, node_id FROM enrollments WHERE token_hash = $1{}",
        B::FOR_UPDATE
    );
    let row = c
        .optional(&sql, &[Arg::Text(token_hash)])
        .await?
        .ok_or(LedgerError::UnknownEnrollment)?;
    let operator = OperatorId::from(row.text("operator_id")?);
    if let Some(node) = row.opt_text("node_id")? {
        let key = c
            .optional(
                "SELECT public_key_text FROM nodes WHERE node_id = $1",
                &[Arg::Text(&node)],
            )
            .await?
            .map(|row| row.text("public_key_text"))
            .transpose()?;
        return if key.as_deref() == Some(public_key_text) {
            Ok((
                Enrollment {
                    node: NodeId::from(node),
                    operator,
                },
                false,
            ))
        } else {
            Err(LedgerError::EnrollmentUsed)
        };
    }
    let now = now_ms();
    if now >= row.i64("expires_at_ms")? {
        return Err(LedgerError::EnrollmentExpired);
    }
    let node = insert_node::<B>(c, &operator, public_key_text, name).await?;
    c.exec(
        "UPDATE enrollments SET node_id = $1, redeemed_at_ms = $2 WHERE token_hash = $3",
        &[
            Arg::Text(node.as_str()),
            Arg::I64(now),
            Arg::Text(token_hash),
        ],
    )
    .await?;
    Ok((Enrollment { node, operator }, true))
}

/// [`Store::operator_nodes`](crate::ledger::Store::operator_nodes): each node's totals are the
/// sums of its rows of the earnings roll-up (`earnings_daily`, operator × day × model × node,
/// schema version 8), which every settlement and every escrow payment keeps in its own
/// transaction, not a count of its request records. The statement reads the operator's
/// roll-up rows once (a range of the `(operator_id, day, model, node_id)` primary key: days ×
/// models × nodes rows, however many requests they count).
pub(in crate::ledger) async fn operator_nodes<B: Backend>(
    b: &B,
    operator: &OperatorId,
) -> Result<Vec<NodeRecord>, LedgerError> {
    // one statement, one snapshot: the operator row, its nodes and their totals
    let rows = b
        .read()
        .await?
        .all(
            "SELECT o.id AS operator_id, n.node_id, n.public_key_text, n.name, n.created_at_ms,
                    COALESCE(e.served, 0) AS served, COALESCE(e.earned, 0) AS earned
             FROM operators o
             LEFT JOIN nodes n ON n.operator_id = o.id
             LEFT JOIN (SELECT node_id, CAST(SUM(requests_served) AS BIGINT) AS served,
                               CAST(SUM(earned_micros) AS BIGINT) AS earned
                        FROM earnings_daily WHERE operator_id = $1 GROUP BY node_id) e
                    ON e.node_id = n.node_id
             WHERE o.id = $1
             ORDER BY n.created_at_ms, n.node_id",
            &[Arg::Text(operator.as_str())],
        )
        .await?;
    if rows.is_empty() {
        return Err(LedgerError::UnknownOperator(operator.clone()));
    }
    let mut nodes = Vec::with_capacity(rows.len());
    for row in &rows {
        let Some(node_id) = row.opt_text("node_id")? else {
            continue; // the operator has no node: one row of NULLs
        };
        nodes.push(NodeRecord {
            node_id: NodeId::from(node_id),
            operator: operator.clone(),
            public_key_text: row.text("public_key_text")?,
            name: row.opt_text("name")?,
            created_at_ms: row.i64("created_at_ms")?,
            requests_served: to_u64(row.i64("served")?, "served")?,
            earned_micros: to_u64(row.i64("earned")?, "earned")?,
        });
    }
    Ok(nodes)
}

/// [`Store::node_for_public_key`](crate::ledger::Store::node_for_public_key).
pub(in crate::ledger) async fn node_for_public_key<B: Backend>(
    b: &B,
    public_key_text: &str,
) -> Result<Option<NodeId>, LedgerError> {
    let node = read_text(
        b,
        "SELECT node_id FROM nodes WHERE public_key_text = $1",
        &[Arg::Text(public_key_text)],
        "node_id",
    )
    .await?;
    Ok(node.map(NodeId::from))
}

/// [`Store::node_operator`](crate::ledger::Store::node_operator).
pub(in crate::ledger) async fn node_operator<B: Backend>(
    b: &B,
    node: &NodeId,
) -> Result<OperatorId, LedgerError> {
    read_text(
        b,
        "SELECT operator_id FROM nodes WHERE node_id = $1",
        &[Arg::Text(node.as_str())],
        "operator_id",
    )
    .await?
    .map(OperatorId::from)
    .ok_or_else(|| LedgerError::UnknownNode(node.clone()))
}
