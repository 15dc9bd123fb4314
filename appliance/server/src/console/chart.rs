//! Small line charts as inline SVG, rendered on the server (no script, no external asset).
//! Colours come from the stylesheet through classes; only numbers are interpolated.

/// Chart size in SVG user units (the stylesheet scales it to the card).
const W: f64 = 320.0;
const H: f64 = 90.0;
const PAD: f64 = 4.0;

/// A line chart of `(x, y)` points: x in milliseconds, y from 0 to the series' maximum (or
/// `floor_max`, whichever is larger, so a flat line near zero does not fill the chart). A `None`
/// y is a gap (an interval with nothing to measure, e.g. no answer finished): the x axis still
/// spans every point, and each run of values between gaps is drawn on its own (a lone value as
/// a dot), so charts sampled together stay aligned and no zero is drawn that was not measured.
pub fn line(points: &[(f64, Option<f64>)], floor_max: f64, label: &str) -> String {
    let mut svg = format!(
        "<svg class=\"chart\" viewBox=\"0 0 {W} {H}\" role=\"img\" aria-label=\"{}\" \
         preserveAspectRatio=\"none\"><line class=\"axis\" x1=\"0\" y1=\"{y0}\" x2=\"{W}\" y2=\"{y0}\"/>",
        escape(label),
        y0 = H - PAD
    );
    if let (Some(first), Some(last)) = (points.first(), points.last()) {
        let (x0, x1) = (first.0, last.0);
        let ymax = points.iter().filter_map(|p| p.1).fold(floor_max, f64::max);
        let sx = |x: f64| {
            if x1 > x0 {
                (x - x0) / (x1 - x0) * W
            } else {
                W
            }
        };
        let sy = |y: f64| H - PAD - (y / ymax).clamp(0.0, 1.0) * (H - 2.0 * PAD);
        let b = H - PAD;
        for run in points.split(|p| p.1.is_none()).filter(|r| !r.is_empty()) {
            let xy: Vec<(f64, f64)> = run
                .iter()
                .map(|&(x, y)| (sx(x), sy(y.unwrap_or(0.0))))
                .collect();
            if let [(x, y)] = xy[..] {
                svg.push_str(&format!(
                    "<circle class=\"point\" cx=\"{x:.1}\" cy=\"{y:.1}\" r=\"2\"/>"
                ));
                continue;
            }
            let pts: Vec<String> = xy.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
            let pts = pts.join(" ");
            svg.push_str(&format!(
                "<polygon class=\"area\" points=\"{:.1},{b} {pts} {:.1},{b}\"/><polyline class=\"line\" points=\"{pts}\"/>",
                xy[0].0,
                xy[xy.len() - 1].0,
            ));
        }
    }
    svg.push_str("</svg>");
    svg
}

/// Minimal XML escaping for attribute text.
fn escape(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

#[cfg(test)]
mod tests {
    #[test]
    fn renders_points_and_escapes() {
        let s = super::line(&[(0.0, Some(1.0)), (10.0, Some(2.0))], 1.0, "a<b");
        assert!(s.starts_with("<svg") && s.contains("polyline") && s.contains("a&lt;b"));
        assert!(!super::line(&[], 1.0, "x").contains("polyline"));
    }

    /// Gaps split the line; a lone value is a dot; the x axis spans the gaps too.
    #[test]
    fn gaps_split_the_line() {
        let pts = [
            (0.0, Some(1.0)),
            (10.0, Some(1.0)),
            (20.0, None),
            (30.0, Some(2.0)),
            (40.0, None),
        ];
        let s = super::line(&pts, 1.0, "ttft");
        assert_eq!(s.matches("<polyline").count(), 1);
        assert_eq!(s.matches("<circle").count(), 1);
        // The first run ends at x = 10 of 0..40, a quarter of the width (320), at half the
        // height (1 of 2).
        assert!(s.contains("points=\"0.0,45.0 80.0,45.0\""), "{s}");
        assert!(s.contains("cx=\"240.0\" cy=\"4.0\""), "{s}");
        assert!(!super::line(&[(0.0, None), (5.0, None)], 1.0, "x").contains("poly"));
    }
}
