//! The "latency by percentile" SVG chart (as HdrHistogram's plotter draws it): the x
//! axis is `log10(1 / (1 - percentile))` labelled 0%, 90%, 99%, 99.9%…, the y axis
//! latency in µs; one curve per input (an imbench JSON summary or an `.hgrm` file).

use std::fmt::Write as _;
use std::io;
use std::path::Path;

/// Most points read from one input.
pub const POINTS_PER_CURVE_MAX: usize = 100_000;
/// Highest x drawn: 99.9999%.
const X_NINES_MAX: f64 = 6.0;
const PALETTE: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// One curve: a name and `(percentile 0..100, µs)` points.
pub struct Curve {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// Parses an HdrHistogram percentile distribution (`Value Percentile ...` rows).
pub fn read_hgrm(text: &str) -> io::Result<Vec<(f64, f64)>> {
    let mut pts = Vec::new();
    for line in text.lines() {
        let mut it = line.split_whitespace();
        let (Some(v), Some(p)) = (it.next(), it.next()) else {
            continue;
        };
        if let (Ok(v), Ok(p)) = (v.parse::<f64>(), p.parse::<f64>()) {
            if pts.len() >= POINTS_PER_CURVE_MAX {
                return Err(io::Error::other("too many points in the .hgrm file"));
            }
            pts.push((p * 100.0, v));
        }
    }
    if pts.is_empty() {
        return Err(io::Error::other("no percentile rows in the .hgrm file"));
    }
    Ok(pts)
}

/// Reads one input: `.hgrm`, or a JSON summary's curve `metric` (e.g. `group-recv`;
/// `recv`/`sendack` pick the first class that has one).
pub fn read_curve(path: &Path, metric: &str) -> io::Result<Curve> {
    let text = std::fs::read_to_string(path)?;
    let stem = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    if path.extension().is_some_and(|e| e == "json") {
        let s: crate::report::Summary = serde_json::from_str(&text).map_err(io::Error::other)?;
        let found = s.curves.iter().find(|(n, _)| n == metric).or_else(|| {
            s.curves
                .iter()
                .find(|(n, _)| n.ends_with(&format!("-{metric}")))
        });
        let (name, pts) = found.ok_or_else(|| {
            io::Error::other(format!("{}: no curve named {metric}", path.display()))
        })?;
        return Ok(Curve {
            name: format!("{} {name}", s.label),
            points: pts.clone(),
        });
    }
    Ok(Curve {
        name: stem,
        points: read_hgrm(&text)?,
    })
}

fn x_of(pct: f64) -> f64 {
    let q = pct / 100.0;
    if q >= 1.0 {
        X_NINES_MAX
    } else {
        (1.0 / (1.0 - q)).log10().min(X_NINES_MAX)
    }
}

fn nice_ceil(v: f64) -> f64 {
    if v <= 0.0 {
        return 1.0;
    }
    let e = 10f64.powf(v.log10().floor());
    for m in [1.0, 2.0, 2.5, 5.0, 10.0] {
        if m * e >= v {
            return m * e;
        }
    }
    10.0 * e
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// The chart's geometry: canvas, plot area, axis ranges.
struct Chart {
    w: f64,
    h: f64,
    /// Left and top margins; plot width and height.
    l: f64,
    t: f64,
    pw: f64,
    ph: f64,
    /// Right end of the x axis (in nines) and top of the y axis (µs).
    xmax: f64,
    ymax: f64,
}

impl Chart {
    fn fitting(curves: &[Curve]) -> Chart {
        let (w, h) = (960.0, 560.0);
        let (l, r, t, b) = (80.0, 30.0, 50.0, 70.0);
        let points = || curves.iter().flat_map(|c| c.points.iter());
        let xmax = points()
            .filter(|p| p.0 < 100.0)
            .map(|p| x_of(p.0))
            .fold(2.0f64, f64::max)
            .ceil()
            .min(X_NINES_MAX);
        let ymax = nice_ceil(points().map(|p| p.1).fold(0.0, f64::max));
        Chart {
            w,
            h,
            l,
            t,
            pw: w - l - r,
            ph: h - t - b,
            xmax,
            ymax,
        }
    }

    fn px(&self, x: f64) -> f64 {
        self.l + self.pw * x.min(self.xmax) / self.xmax
    }

    fn py(&self, y: f64) -> f64 {
        self.t + self.ph * (1.0 - y / self.ymax)
    }

    /// The canvas and the title.
    fn head(&self, s: &mut String, title: &str) {
        let (w, h) = (self.w, self.h);
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{w}" height="{h}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="28" text-anchor="middle" font-size="16">{}</text>"#,
            w / 2.0,
            esc(title)
        );
    }

    /// Grid lines and tick labels: six on the latency axis, one per nine.
    fn grid(&self, s: &mut String) {
        let (l, t, pw, ph, ymax) = (self.l, self.t, self.pw, self.ph, self.ymax);
        for i in 0..=5 {
            let y = ymax * f64::from(i) / 5.0;
            let yy = self.py(y);
            let _ = writeln!(
                s,
                r##"<line x1="{l}" y1="{yy:.1}" x2="{:.1}" y2="{yy:.1}" stroke="#ddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                l + pw,
                l - 6.0,
                yy + 4.0,
                if ymax < 10.0 {
                    format!("{y:.1}")
                } else {
                    format!("{y:.0}")
                }
            );
        }
        for n in 0..=(self.xmax as usize) {
            let xx = self.px(n as f64);
            let label = match n {
                0 => "0%".to_string(),
                n => format!("{}%", 100.0 - 100.0 / 10f64.powi(n as i32)),
            };
            let _ = writeln!(
                s,
                r##"<line x1="{xx:.1}" y1="{t}" x2="{xx:.1}" y2="{:.1}" stroke="#ddd"/><text x="{xx:.1}" y="{:.1}" text-anchor="middle">{label}</text>"##,
                t + ph,
                t + ph + 18.0
            );
        }
    }

    /// The plot area's frame and the axis names.
    fn axes(&self, s: &mut String) {
        let (l, t, pw, ph) = (self.l, self.t, self.pw, self.ph);
        let _ = writeln!(
            s,
            r##"<rect x="{l}" y="{t}" width="{pw}" height="{ph}" fill="none" stroke="#333"/>"##
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">percentile</text>"#,
            l + pw / 2.0,
            self.h - 25.0
        );
        let _ = writeln!(
            s,
            r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">latency (µs)</text>"#,
            t + ph / 2.0,
            t + ph / 2.0
        );
    }

    /// Curve number `i` and its legend entry.
    fn curve(&self, s: &mut String, i: usize, c: &Curve) {
        let color = PALETTE[i % PALETTE.len()];
        let mut d = String::new();
        for (j, (p, v)) in c.points.iter().enumerate() {
            let _ = write!(
                d,
                "{}{:.1},{:.1} ",
                if j == 0 { "M" } else { "L" },
                self.px(x_of(*p)),
                self.py(*v)
            );
        }
        let _ = writeln!(
            s,
            r#"<path d="{d}" fill="none" stroke="{color}" stroke-width="2"/>"#
        );
        let ly = self.t + 18.0 + 18.0 * i as f64;
        let _ = writeln!(
            s,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{color}" stroke-width="3"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            self.l + 12.0,
            self.l + 36.0,
            self.l + 42.0,
            ly + 4.0,
            esc(&c.name)
        );
    }
}

/// The SVG text of the chart.
pub fn svg(curves: &[Curve], title: &str) -> String {
    let chart = Chart::fitting(curves);
    let mut s = String::new();
    chart.head(&mut s, title);
    chart.grid(&mut s);
    chart.axes(&mut s);
    for (i, c) in curves.iter().enumerate() {
        chart.curve(&mut s, i, c);
    }
    s.push_str("</svg>\n");
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn x_axis_is_nines() {
        assert!((x_of(90.0) - 1.0).abs() < 1e-9);
        assert!((x_of(99.9) - 3.0).abs() < 1e-6);
        assert_eq!(x_of(100.0), X_NINES_MAX);
    }

    #[test]
    fn svg_has_one_path_per_curve() {
        let c = |n: &str| Curve {
            name: n.into(),
            points: vec![(0.0, 10.0), (50.0, 20.0), (99.0, 80.0), (100.0, 120.0)],
        };
        let s = svg(&[c("a"), c("b<")], "t");
        assert_eq!(s.matches("<path").count(), 2);
        assert!(s.contains("b&lt;"));
        assert!(s.contains("99%"));
    }
}
