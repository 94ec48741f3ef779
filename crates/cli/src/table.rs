//! Plain-text tables and the human formats of times and sizes in them.
//! Pure functions, so the output is tested without a daemon.

use time::OffsetDateTime;

/// Left-aligned columns separated by three spaces; the last column is not
/// padded, so lines carry no trailing blanks.
pub fn render(headers: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = headers.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let mut out = String::new();
    let header: Vec<String> = headers.iter().map(|h| (*h).to_owned()).collect();
    for row in std::iter::once(&header).chain(rows) {
        let last = row.len().saturating_sub(1);
        for (i, (cell, width)) in row.iter().zip(&widths).enumerate() {
            if i == last {
                out.push_str(cell);
            } else {
                out.push_str(cell);
                let pad = width - cell.chars().count() + 3;
                out.extend(std::iter::repeat_n(' ', pad));
            }
        }
        out.push('\n');
    }
    out
}

/// How long until `when`, e.g. `in 29m05s`, `in 3h01m`, `in 12d04h`, or
/// `expired`.
pub fn until(when: OffsetDateTime, now: OffsetDateTime) -> String {
    let secs = (when - now).whole_seconds();
    if secs <= 0 {
        return "expired".to_owned();
    }
    let (d, h, m, s) = (secs / 86400, secs / 3600, secs / 60 % 60, secs % 60);
    if d >= 2 {
        format!("in {d}d{:02}h", h % 24)
    } else if h > 0 {
        format!("in {h}h{m:02}m")
    } else if m > 0 {
        format!("in {m}m{s:02}s")
    } else {
        format!("in {s}s")
    }
}

/// A UTC timestamp to the minute, e.g. `2025-01-31 14:05`.
pub fn date(when: OffsetDateTime) -> String {
    let utc = when.to_offset(time::UtcOffset::UTC);
    format!(
        "{}-{:02}-{:02} {:02}:{:02}",
        utc.year(),
        u8::from(utc.month()),
        utc.day(),
        utc.hour(),
        utc.minute()
    )
}

/// A byte count in binary units, e.g. `12.5 MiB`.
pub fn size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["KiB", "MiB", "GiB", "TiB", "PiB"];
    if bytes < 1024 {
        return format!("{bytes} B");
    }
    // Precision beyond one decimal is noise in a listing, so f64 is enough.
    let mut value = bytes as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.1} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use time::Duration;

    use super::*;

    #[test]
    fn columns_line_up_without_trailing_blanks() {
        let rows = vec![
            vec!["a".to_owned(), "long value".to_owned(), "x".to_owned()],
            vec!["bbbb".to_owned(), "v".to_owned(), "yy".to_owned()],
        ];
        let text = render(&["K", "VALUE", "END"], &rows);
        assert_eq!(
            text,
            "K      VALUE        END\n\
             a      long value   x\n\
             bbbb   v            yy\n"
        );
        assert_eq!(render(&["K"], &[]), "K\n");
    }

    #[test]
    fn durations_read_naturally() {
        let now = OffsetDateTime::UNIX_EPOCH;
        assert_eq!(until(now, now), "expired");
        assert_eq!(until(now + Duration::seconds(45), now), "in 45s");
        assert_eq!(
            until(now + Duration::seconds(29 * 60 + 5), now),
            "in 29m05s"
        );
        assert_eq!(
            until(now + Duration::seconds(3 * 3600 + 60), now),
            "in 3h01m"
        );
        assert_eq!(until(now + Duration::hours(47), now), "in 47h00m");
        assert_eq!(until(now + Duration::hours(12 * 24 + 4), now), "in 12d04h");
        assert_eq!(until(now - Duration::seconds(5), now), "expired");
    }

    #[test]
    fn dates_and_sizes() {
        assert_eq!(
            date(OffsetDateTime::UNIX_EPOCH + Duration::minutes(61)),
            "1970-01-01 01:01"
        );
        assert_eq!(size(512), "512 B");
        assert_eq!(size(1536), "1.5 KiB");
        assert_eq!(size(5 * 1024 * 1024 * 1024), "5.0 GiB");
    }
}
