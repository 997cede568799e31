//! The chart's Grafana dashboard as the tests read it: each panel's queries, the metric names
//! they use, and a query with the dashboard's variables filled in for one pipeline.

use std::collections::BTreeSet;

use anyhow::Context as _;
use serde_json::Value;

/// The dashboard file the chart ships.
pub const FILE: &str = "charts/stoker/files/dashboards/stoker-pipelines.json";

/// One query of a panel.
#[derive(Clone, Debug)]
pub struct Query {
    pub panel: String,
    pub expr: String,
}

/// Every query of every panel of the chart's dashboard.
pub fn queries() -> anyhow::Result<Vec<Query>> {
    let path = crate::tools::workspace_root().join(FILE);
    let text = std::fs::read_to_string(&path).with_context(|| path.display().to_string())?;
    let dashboard: Value = serde_json::from_str(&text).with_context(|| path.display().to_string())?;
    let mut out = Vec::new();
    for panel in dashboard["panels"].as_array().context("the dashboard has panels")? {
        let title = panel["title"].as_str().unwrap_or_default();
        for target in panel["targets"].as_array().into_iter().flatten() {
            let expr = target["expr"].as_str().with_context(|| format!("a query of {title:?} has no expr"))?;
            out.push(Query { panel: title.to_string(), expr: expr.to_string() });
        }
    }
    Ok(out)
}

/// The metric names a query selects: every `stoker_...` identifier in it.
pub fn metric_names(expr: &str) -> BTreeSet<String> {
    let is_name = |c: char| c.is_ascii_alphanumeric() || c == '_';
    let mut names = BTreeSet::new();
    let mut rest = expr;
    while let Some(at) = rest.find("stoker_") {
        // Only where an identifier starts, not inside a label value or another name.
        let starts = rest[..at].chars().next_back().is_none_or(|c| !is_name(c) && c != '"');
        let len = rest[at..].find(|c: char| !is_name(c)).unwrap_or(rest.len() - at);
        if starts {
            names.insert(rest[at..at + len].to_string());
        }
        rest = &rest[at + len..];
    }
    names
}

/// `expr` with the dashboard's variables set for one pipeline, as Grafana would send it.
pub fn for_pipeline(expr: &str, namespace: &str, pipeline: &str, rate_interval: &str) -> String {
    expr.replace("$namespace", namespace).replace("$pipeline", pipeline).replace("$__rate_interval", rate_interval)
}

/// The metric families in Prometheus text `exposition` (histograms by their base name).
pub fn exported_names(exposition: &str) -> BTreeSet<String> {
    exposition
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|l| l.split_whitespace().next())
        .map(str::to_string)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_read_where_identifiers_start() {
        let expr = r#"sum(rate(stoker_worker_op_seconds_total{pipeline="stoker_x"}[1m])) / stoker_pipeline_workers"#;
        let names: Vec<String> = metric_names(expr).into_iter().collect();
        assert_eq!(names, ["stoker_pipeline_workers", "stoker_worker_op_seconds_total"]);
        assert_eq!(
            for_pipeline(r#"x{namespace="$namespace", pipeline=~"$pipeline"}[$__rate_interval]"#, "a", "b", "30s"),
            r#"x{namespace="a", pipeline=~"b"}[30s]"#
        );
    }
}
