//! Small line charts as inline SVG, rendered on the server (no script, no external asset).
//! Colours come from the stylesheet through classes; only numbers are interpolated.

/// Chart size in SVG user units (the stylesheet scales it to the card).
const W: f64 = 320.0;
const H: f64 = 90.0;
const PAD: f64 = 4.0;

/// A line chart of `(x, y)` points: x in milliseconds, y from 0 to the series' maximum (or
/// `floor_max`, whichever is larger, so a flat line near zero does not fill the chart).
pub fn line(points: &[(f64, f64)], floor_max: f64, label: &str) -> String {
    let mut svg = format!(
        "<svg class=\"chart\" viewBox=\"0 0 {W} {H}\" role=\"img\" aria-label=\"{}\" \
         preserveAspectRatio=\"none\"><line class=\"axis\" x1=\"0\" y1=\"{y0}\" x2=\"{W}\" y2=\"{y0}\"/>",
        escape(label),
        y0 = H - PAD
    );
    if points.len() >= 2 {
        let (x0, x1) = (points[0].0, points[points.len() - 1].0);
        let ymax = points.iter().map(|p| p.1).fold(floor_max, f64::max);
        let sx = |x: f64| {
            if x1 > x0 {
                (x - x0) / (x1 - x0) * W
            } else {
                0.0
            }
        };
        let sy = |y: f64| H - PAD - (y / ymax).clamp(0.0, 1.0) * (H - 2.0 * PAD);
        let pts: Vec<String> = points
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
            .collect();
        svg.push_str(&format!(
            "<polygon class=\"area\" points=\"0,{b} {} {W},{b}\"/><polyline class=\"line\" points=\"{}\"/>",
            pts.join(" "),
            pts.join(" "),
            b = H - PAD
        ));
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
        let s = super::line(&[(0.0, 1.0), (10.0, 2.0)], 1.0, "a<b");
        assert!(s.starts_with("<svg") && s.contains("polyline") && s.contains("a&lt;b"));
        assert!(!super::line(&[], 1.0, "x").contains("polyline"));
    }
}
