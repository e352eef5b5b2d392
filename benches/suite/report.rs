//! The printed result: one row per figure with its baseline from the same run, the ratio
//! (or difference) the target is stated in, the target, and PASS/MISS. Printing only:
//! a missed target never makes the suite fail.

use std::fmt::Write as _;

/// How a row's figure is judged against its target.
#[derive(Debug, Clone, Copy)]
pub enum Target {
    /// figure / baseline ≤ limit.
    Ratio(f64),
    /// figure − baseline ≤ limit (both in the same unit, e.g. ms).
    Plus(f64),
    /// figure ≤ limit, whatever the baseline.
    Absolute(f64),
    /// No target: shown for context.
    Info,
}

/// One line of the table.
#[derive(Debug, Clone)]
pub struct Row {
    pub figure: String,
    pub measured: String,
    pub baseline: String,
    /// What the target compares: the ratio, the difference, or the value itself.
    pub compared: String,
    pub target: String,
    pub verdict: Option<bool>,
}

impl Row {
    /// A row whose numbers are `value` and `base` (same unit), judged by `target`.
    /// `measured` and `baseline` are the printed forms (with their own detail).
    pub fn judged(
        figure: impl Into<String>,
        measured: String,
        baseline: String,
        value: f64,
        base: f64,
        target: Target,
        unit: &str,
    ) -> Row {
        let ratio = if base > 0.0 { value / base } else { f64::NAN };
        let (compared, target_text, verdict) = match target {
            Target::Ratio(limit) => (
                format!("{ratio:.2}x"),
                format!("≤ {limit}x"),
                Some(ratio <= limit),
            ),
            Target::Plus(limit) => (
                format!("{:+.2} {unit} ({ratio:.2}x)", value - base),
                format!("≤ +{limit:.2} {unit}"),
                Some(value - base <= limit),
            ),
            Target::Absolute(limit) => (
                if base > 0.0 {
                    format!("{ratio:.2}x")
                } else {
                    "—".into()
                },
                format!("≤ {limit} {unit}"),
                Some(value <= limit),
            ),
            Target::Info => (
                if base > 0.0 {
                    format!("{ratio:.2}x")
                } else {
                    "—".into()
                },
                "—".into(),
                None,
            ),
        };
        Row {
            figure: figure.into(),
            measured,
            baseline,
            compared,
            target: target_text,
            verdict,
        }
    }

    /// A figure that could not be measured, with the reason in its place.
    pub fn not_measured(figure: impl Into<String>, why: impl Into<String>) -> Row {
        Row {
            figure: figure.into(),
            measured: format!("not measured: {}", why.into()),
            baseline: String::new(),
            compared: String::new(),
            target: String::new(),
            verdict: None,
        }
    }
}

/// The whole table as Markdown (so a run can be pasted into docs/benchmarks.md).
pub fn table(rows: &[Row]) -> String {
    let mut out = String::new();
    out.push_str(
        "| figure | measured | baseline (same run) | ratio / difference | target | verdict |\n",
    );
    out.push_str("|---|---|---|---|---|---|\n");
    for r in rows {
        let verdict = match r.verdict {
            Some(true) => "PASS",
            Some(false) => "MISS",
            None => "",
        };
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {} | {} |",
            r.figure, r.measured, r.baseline, r.compared, r.target, verdict
        );
    }
    out
}
