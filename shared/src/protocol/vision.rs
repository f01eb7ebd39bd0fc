//! Images in chat requests (SPEC §10): measured, never decoded; fetched, never by us.
//!
//! A `data:` URI is measured arithmetically from its text, so a large image costs no
//! allocation to refuse. A remote URL is accepted only when its origin is exactly one of
//! `ai.vision.allowed_origins`: origins are parsed and compared whole, never as string
//! prefixes, so `https://img.example.com.evil.net` or `https://img.example.com@evil.net`
//! cannot pass for `https://img.example.com`. The parser is deliberately stricter than a
//! browser's: anything it is unsure of is refused, never guessed.

use crate::config::VisionPolicy;
use crate::protocol::openai::ImageRef;

/// Why an image was refused.
#[derive(Debug, Clone, thiserror::Error, PartialEq, Eq)]
pub enum VisionError {
    #[error("an image is {size} bytes, over the limit of {limit} bytes (ai.vision.max_image_bytes)")]
    TooLarge { limit: u64, size: u64 },
    #[error(
        "image URL origin `{origin}` is not allowed: remote images must be under a declared https origin (ai.vision.allowed_origins)"
    )]
    OriginNotAllowed { origin: String },
    #[error("{0}")]
    Invalid(String),
}

impl From<VisionError> for crate::error::GatewayError {
    fn from(err: VisionError) -> Self {
        use crate::error::GatewayError;
        match err {
            VisionError::TooLarge { limit, .. } => GatewayError::ImageTooLarge { limit },
            VisionError::OriginNotAllowed { origin } => GatewayError::ImageOriginNotAllowed { origin },
            VisionError::Invalid(message) => {
                GatewayError::InvalidRequest(crate::call::InvalidRequest { message, param: Some("messages") })
            }
        }
    }
}

/// Checks every image of a request against the policy; the first refusal wins.
pub fn check_images(images: &[ImageRef], policy: &VisionPolicy) -> Result<(), VisionError> {
    images.iter().try_for_each(|image| check_image(&image.url, policy))
}

/// Checks one image URL: a `data:` URI within `max_image_bytes`, or an https URL under
/// an allowed origin.
pub fn check_image(url: &str, policy: &VisionPolicy) -> Result<(), VisionError> {
    let Some(scheme) = scheme_of(url) else {
        return Err(VisionError::Invalid("an image URL must be a data: URI or an https URL".to_owned()));
    };
    if scheme.eq_ignore_ascii_case("data") {
        let size = data_uri_decoded_len(url)?;
        if size > policy.max_image_bytes {
            return Err(VisionError::TooLarge { limit: policy.max_image_bytes, size });
        }
        return Ok(());
    }
    if !scheme.eq_ignore_ascii_case("https") {
        // Name what was asked for: `http://host` when there is one, else `file:` etc.
        let origin = origin_of(url).unwrap_or_else(|| format!("{}:", scheme.to_ascii_lowercase()));
        return Err(VisionError::OriginNotAllowed { origin });
    }
    let origin = parse_origin(url).map_err(|reason| VisionError::Invalid(format!("invalid image URL: {reason}")))?;
    // Allowed origins are normalised the same way, so `:443` declared or not compares equal.
    let allowed = policy.allowed_origins.iter().any(|declared| origin_of(declared).as_deref() == Some(origin.as_str()));
    if allowed { Ok(()) } else { Err(VisionError::OriginNotAllowed { origin }) }
}

/// The decoded size of a `data:` URI's payload, computed from its text without
/// decoding: base64 arithmetically (whitespace ignored, padding accounted for), other
/// data percent-decoded (`%XX` is one byte). The alphabet and escapes are checked.
pub fn data_uri_decoded_len(uri: &str) -> Result<u64, VisionError> {
    let rest = uri
        .get(..5)
        .filter(|prefix| prefix.eq_ignore_ascii_case("data:"))
        .and_then(|_| uri.get(5..))
        .ok_or_else(|| VisionError::Invalid("not a data: URI".to_owned()))?;
    let Some((header, data)) = rest.split_once(',') else {
        return Err(VisionError::Invalid(
            "invalid data: URI: no comma before the data (data:[<mediatype>][;base64],<data>)".to_owned(),
        ));
    };
    let is_base64 = header
        .len()
        .checked_sub(7)
        .and_then(|at| header.get(at..))
        .is_some_and(|suffix| suffix.eq_ignore_ascii_case(";base64"));
    if is_base64 { base64_decoded_len(data.as_bytes()) } else { percent_decoded_len(data.as_bytes()) }
}

fn base64_decoded_len(data: &[u8]) -> Result<u64, VisionError> {
    let invalid = |why: &str| VisionError::Invalid(format!("invalid data: URI: {why}"));
    let mut symbols: u64 = 0;
    let mut padding: u64 = 0;
    for &byte in data {
        match byte {
            b if b.is_ascii_whitespace() => {}
            b'=' => padding += 1,
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'+' | b'/' if padding == 0 => symbols += 1,
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'+' | b'/' => {
                return Err(invalid("base64 data continues after `=` padding"));
            }
            _ => return Err(invalid("a character outside the base64 alphabet")),
        }
    }
    let tail = match (symbols % 4, padding) {
        (0, 0) => 0,
        (2, 0 | 2) => 1,
        (3, 0 | 1) => 2,
        _ => return Err(invalid("base64 data of an impossible length or padding")),
    };
    Ok(symbols / 4 * 3 + tail)
}

fn percent_decoded_len(data: &[u8]) -> Result<u64, VisionError> {
    let mut len: u64 = 0;
    let mut bytes = data.iter();
    while let Some(&byte) = bytes.next() {
        if byte == b'%' {
            let escape = (bytes.next(), bytes.next());
            if !matches!(escape, (Some(h), Some(l)) if h.is_ascii_hexdigit() && l.is_ascii_hexdigit()) {
                return Err(VisionError::Invalid(
                    "invalid data: URI: `%` must be followed by two hex digits".to_owned(),
                ));
            }
        }
        len += 1;
    }
    Ok(len)
}

/// The origin of a URL with an authority, `scheme://host[:port]`: scheme and host
/// lower-cased, the scheme's default port (443 for https, 80 for http) omitted. `None`
/// when there is no authority, or it carries user info or anything that is not a plain
/// host name, IPv4 or bracketed IPv6 address.
pub fn origin_of(url: &str) -> Option<String> {
    parse_origin(url).ok()
}

fn parse_origin(url: &str) -> Result<String, &'static str> {
    let scheme = scheme_of(url).ok_or("no scheme")?.to_ascii_lowercase();
    let rest = url.get(scheme.len() + 1..).unwrap_or_default();
    let Some(rest) = rest.strip_prefix("//") else {
        return Err("no host (expected scheme://host/...)");
    };
    let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
    let authority = rest.get(..end).unwrap_or_default();
    if authority.contains('@') {
        return Err("user info (`user@`) is not allowed before the host");
    }
    let (host, port) = split_host_port(authority)?;
    let host = host.to_ascii_lowercase();
    let default_port = match scheme.as_str() {
        "https" => Some(443),
        "http" => Some(80),
        _ => None,
    };
    match port {
        Some(port) if Some(port) != default_port => Ok(format!("{scheme}://{host}:{port}")),
        _ => Ok(format!("{scheme}://{host}")),
    }
}

/// `host`, `host:port`, `[v6]` or `[v6]:port`; an empty port is the default one.
fn split_host_port(authority: &str) -> Result<(&str, Option<u16>), &'static str> {
    let (host, port) = if authority.starts_with('[') {
        let close = authority.find(']').ok_or("unclosed `[` in the host")?;
        let (host, after) = authority.split_at(close + 1);
        let inner = host.get(1..host.len() - 1).unwrap_or_default();
        if inner.is_empty() || !inner.bytes().all(|b| b.is_ascii_hexdigit() || b == b':' || b == b'.') {
            return Err("an invalid IPv6 address");
        }
        match after {
            "" => (host, None),
            _ => (host, Some(after.strip_prefix(':').ok_or("unexpected text after the IPv6 address")?)),
        }
    } else {
        match authority.split_once(':') {
            Some((host, port)) => (host, Some(port)),
            None => (authority, None),
        }
    };
    if host.is_empty() {
        return Err("an empty host");
    }
    if !host.starts_with('[') && !host.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_')) {
        return Err("a host with characters other than letters, digits, `-`, `.` and `_`");
    }
    let port = match port {
        None | Some("") => None,
        Some(digits) if digits.bytes().all(|b| b.is_ascii_digit()) => {
            Some(digits.parse::<u16>().map_err(|_| "a port above 65535")?)
        }
        Some(_) => return Err("a port that is not a number"),
    };
    Ok((host, port))
}

/// The scheme of an absolute URL (RFC 3986: a letter, then letters, digits, `+-.`).
fn scheme_of(url: &str) -> Option<&str> {
    let (scheme, _) = url.split_once(':')?;
    let mut bytes = scheme.bytes();
    let first_is_letter = bytes.next().is_some_and(|b| b.is_ascii_alphabetic());
    (first_is_letter && bytes.all(|b| b.is_ascii_alphanumeric() || matches!(b, b'+' | b'-' | b'.'))).then_some(scheme)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy(max_image_bytes: u64, allowed: &[&str]) -> VisionPolicy {
        VisionPolicy {
            max_image_bytes,
            max_body_bytes: 24 * 1024 * 1024,
            allowed_origins: allowed.iter().map(|o| (*o).to_owned()).collect(),
        }
    }

    fn images(urls: &[&str]) -> Vec<ImageRef> {
        urls.iter().map(|u| ImageRef { url: (*u).to_owned() }).collect()
    }

    fn is_invalid(result: &Result<impl std::fmt::Debug, VisionError>) -> bool {
        matches!(result, Err(VisionError::Invalid(_)))
    }

    #[test]
    fn base64_sizes_are_computed_without_decoding() {
        let cases: &[(&str, u64)] = &[
            ("data:image/png;base64,", 0),
            ("data:image/png;base64,QQ==", 1),
            ("data:image/png;base64,QUI=", 2),
            ("data:image/png;base64,QUJD", 3),
            ("data:image/png;base64,QUJDRA==", 4),
            ("data:image/png;base64,QUJDREU=", 5),
            ("data:image/png;base64,QUJDREVG", 6),
            // Unpadded.
            ("data:image/png;base64,QQ", 1),
            ("data:image/png;base64,QUI", 2),
            ("data:image/png;base64,QUJDRA", 4),
            // Whitespace anywhere, padding included.
            ("data:image/png;base64,QUJD\r\nREVG", 6),
            ("data:image/png;base64, Q U J D \tRA= =\n", 4),
            // All of the alphabet.
            ("data:image/png;base64,ab+/09Zz", 6),
            // Case-insensitive scheme and marker; parameters before it; empty media type.
            ("DATA:image/png;BASE64,QUJD", 3),
            ("data:image/png;name=a.png;base64,QUJD", 3),
            ("data:;base64,QQ==", 1),
        ];
        for (uri, expected) in cases {
            assert_eq!(data_uri_decoded_len(uri), Ok(*expected), "{uri}");
        }
    }

    #[test]
    fn malformed_base64_is_invalid() {
        let cases = [
            "data:image/png;base64,Q",
            "data:image/png;base64,QUJDR",
            "data:image/png;base64,QQ=",
            "data:image/png;base64,QUI==",
            "data:image/png;base64,QQ===",
            "data:image/png;base64,====",
            "data:image/png;base64,QUJD=",
            "data:image/png;base64,QQ==QQ==",
            "data:image/png;base64,QQ=A",
            "data:image/png;base64,QU*D",
            "data:image/png;base64,QU-_",
            "data:image/png;base64,QUJD%3D",
            "data:image/png;base64,QUJDé",
            "data:image/png;base64,QUJD\0",
        ];
        for uri in cases {
            assert!(is_invalid(&data_uri_decoded_len(uri)), "{uri}");
        }
    }

    #[test]
    fn plain_data_is_measured_percent_decoded() {
        let cases: &[(&str, u64)] = &[
            ("data:,", 0),
            ("data:,abc", 3),
            ("data:text/plain,Hello%2C%20World", 12),
            ("data:,%41%42%43", 3),
            ("data:,%e2%82%AC", 3),
            ("data:,a b", 3),
            ("data:,é", 2),
            // Without the `;base64` marker, base64-looking text is taken as it is.
            ("data:base64,QQ==", 4),
        ];
        for (uri, expected) in cases {
            assert_eq!(data_uri_decoded_len(uri), Ok(*expected), "{uri}");
        }
        for uri in ["data:,%", "data:,%4", "data:,%zz", "data:,ab%4", "data:,%%41"] {
            assert!(is_invalid(&data_uri_decoded_len(uri)), "{uri}");
        }
    }

    #[test]
    fn data_uri_without_comma_or_prefix_is_invalid() {
        for uri in ["data:image/png;base64", "data:", "https://img.example.com/a.png", "dat", ""] {
            assert!(is_invalid(&data_uri_decoded_len(uri)), "{uri}");
        }
    }

    #[test]
    fn data_images_are_refused_one_byte_over_the_limit() {
        let cases: &[(&str, u64, Result<(), VisionError>)] = &[
            ("data:image/png;base64,QUJD", 3, Ok(())),
            ("data:image/png;base64,QUJDRA==", 3, Err(VisionError::TooLarge { limit: 3, size: 4 })),
            ("data:image/png;base64,QUJDRA==", 4, Ok(())),
            ("data:image/png;base64,QUJDRA", 4, Ok(())),
            ("data:image/png;base64,QUJDREU=", 4, Err(VisionError::TooLarge { limit: 4, size: 5 })),
            ("data:,ab%20c", 4, Ok(())),
            ("data:,ab%20cd", 4, Err(VisionError::TooLarge { limit: 4, size: 5 })),
            ("data:image/png;base64,", 0, Ok(())),
        ];
        for (uri, limit, expected) in cases {
            assert_eq!(check_image(uri, &policy(*limit, &[])), *expected, "{uri} within {limit}");
        }
    }

    #[test]
    fn eight_mib_image_fits_exactly_and_one_more_byte_does_not() {
        const LIMIT: u64 = 8 * 1024 * 1024;
        let policy = policy(LIMIT, &[]);
        // 8 MiB = 3 × 2_796_202 + 2: full groups then one padded group of two bytes.
        let at_limit = format!("data:image/png;base64,{}AAA=", "AAAA".repeat(2_796_202));
        assert_eq!(data_uri_decoded_len(&at_limit), Ok(LIMIT));
        assert_eq!(check_image(&at_limit, &policy), Ok(()));
        let over = format!("data:image/png;base64,{}", "AAAA".repeat(2_796_203));
        assert_eq!(check_image(&over, &policy), Err(VisionError::TooLarge { limit: LIMIT, size: LIMIT + 1 }));
    }

    #[test]
    fn remote_images_need_an_allowed_https_origin() {
        let policy = policy(1024, &["https://img.example.com", "https://cdn.example.org:8443"]);
        let accepted = [
            "https://img.example.com/a.png",
            "https://IMG.example.com/a.png",
            "HTTPS://Img.Example.Com/a.png",
            "https://img.example.com:443/a.png",
            "https://img.example.com:0443/a.png",
            "https://img.example.com:/a.png",
            "https://img.example.com",
            "https://img.example.com?size=large",
            "https://img.example.com#top",
            "https://img.example.com/a.png?u=https://evil.net",
            "https://img.example.com/redirect/@evil.net",
            "https://cdn.example.org:8443/x.jpg",
        ];
        for url in accepted {
            assert_eq!(check_image(url, &policy), Ok(()), "{url}");
        }
        let refused: &[(&str, &str)] = &[
            ("https://img.example.com.evil.net/x", "https://img.example.com.evil.net"),
            ("https://evil.net/?https://img.example.com", "https://evil.net"),
            ("https://evil.net#https://img.example.com", "https://evil.net"),
            ("https://evil.net/img.example.com", "https://evil.net"),
            ("https://img.example.com:8443/x", "https://img.example.com:8443"),
            ("https://cdn.example.org/x.jpg", "https://cdn.example.org"),
            ("https://example.com/x", "https://example.com"),
            ("https://sub.img.example.com/x", "https://sub.img.example.com"),
            ("https://img-example.com/x", "https://img-example.com"),
            ("https://[::1]/x", "https://[::1]"),
            ("http://img.example.com/x", "http://img.example.com"),
            ("http://img.example.com:443/x", "http://img.example.com:443"),
            ("ftp://img.example.com/x", "ftp://img.example.com"),
            ("file:///etc/passwd", "file:"),
            ("javascript:alert(1)", "javascript:"),
            ("JavaScript:alert(1)", "javascript:"),
        ];
        for (url, origin) in refused {
            assert_eq!(
                check_image(url, &policy),
                Err(VisionError::OriginNotAllowed { origin: (*origin).to_owned() }),
                "{url}"
            );
        }
    }

    #[test]
    fn malformed_or_ambiguous_https_urls_are_invalid() {
        let policy = policy(1024, &["https://img.example.com"]);
        let cases = [
            "https://img.example.com@evil.net/x",
            "https://user:pw@img.example.com/x",
            "https://@img.example.com/x",
            "https://img.example.com\\@evil.net/x",
            "https://evil.net\\.img.example.com/x",
            "https://img%2Eexample.com/x",
            "https://img.exa mple.com/x",
            "https://img.exa\tmple.com/x",
            "https://imɡ.example.com/x",
            "https:img.example.com/x",
            "https:/img.example.com/x",
            "https:///img.example.com/x",
            "https://",
            "https://:443/x",
            "https://img.example.com:99999/x",
            "https://img.example.com:+443/x",
            "https://img.example.com:44a/x",
            "https://img.example.com:443:443/x",
            "https://[::1/x",
            "https://[]/x",
            "https://[::1]x/x",
            "https://[evil.net]/x",
            " https://img.example.com/x",
            "//img.example.com/x",
            "img.example.com/a.png",
            "a.png",
            "",
        ];
        for url in cases {
            assert!(is_invalid(&check_image(url, &policy)), "{url}: {:?}", check_image(url, &policy));
        }
    }

    #[test]
    fn declared_origins_are_compared_normalised() {
        // The config may keep an explicit default port; it is the same origin.
        let policy = policy(1024, &["https://img.example.com:443"]);
        assert_eq!(check_image("https://img.example.com/a.png", &policy), Ok(()));
        assert_eq!(check_image("https://img.example.com:443/a.png", &policy), Ok(()));
    }

    #[test]
    fn no_allowed_origins_refuses_every_remote_image() {
        let policy = policy(1024, &[]);
        assert_eq!(
            check_image("https://img.example.com/a.png", &policy),
            Err(VisionError::OriginNotAllowed { origin: "https://img.example.com".to_owned() })
        );
    }

    #[test]
    fn origin_of_normalises() {
        let cases: &[(&str, Option<&str>)] = &[
            ("https://IMG.Example.COM:443/a", Some("https://img.example.com")),
            ("https://img.example.com", Some("https://img.example.com")),
            ("https://img.example.com:8443", Some("https://img.example.com:8443")),
            ("HTTPS://img.example.com:08443/x", Some("https://img.example.com:8443")),
            ("https://img.example.com?q#f", Some("https://img.example.com")),
            ("https://[2001:DB8::1]:8443/x", Some("https://[2001:db8::1]:8443")),
            ("https://127.0.0.1:443/x", Some("https://127.0.0.1")),
            ("http://img.example.com:80/x", Some("http://img.example.com")),
            ("http://img.example.com:443/x", Some("http://img.example.com:443")),
            ("https://a@b/", None),
            ("https://img.example.com:65536/", None),
            ("data:,x", None),
            ("javascript:alert(1)", None),
            ("no scheme", None),
        ];
        for (url, expected) in cases {
            assert_eq!(origin_of(url).as_deref(), *expected, "{url}");
        }
    }

    #[test]
    fn check_images_reports_the_first_refusal() {
        let policy = policy(3, &["https://img.example.com"]);
        let ok = images(&["data:image/png;base64,QUJD", "https://img.example.com/a.png"]);
        assert_eq!(check_images(&ok, &policy), Ok(()));
        assert_eq!(check_images(&[], &policy), Ok(()));
        let mixed =
            images(&["https://img.example.com/a.png", "https://evil.net/b.png", "data:image/png;base64,QUJDRA=="]);
        assert_eq!(
            check_images(&mixed, &policy),
            Err(VisionError::OriginNotAllowed { origin: "https://evil.net".to_owned() })
        );
    }

    #[test]
    fn error_messages_name_the_limit_and_the_size() {
        let message = VisionError::TooLarge { limit: 8, size: 9 }.to_string();
        assert!(message.contains('8') && message.contains('9'), "{message}");
        let message = check_image("data:image/png;base64,Q", &policy(8, &[])).unwrap_err().to_string();
        assert!(message.contains("data: URI"), "{message}");
    }
}
