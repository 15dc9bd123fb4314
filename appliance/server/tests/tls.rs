//! TLS on the daemon's listener, checked with curl as a client would: a self-signed
//! certificate generated at the first start, verified with `--cacert`, its fingerprint kept,
//! HSTS on every answer, plain HTTP redirected to https, and a second start reusing the pair.

mod common;

use std::process::Command;

/// `curl` with `args`: (exit status, stdout).
fn curl(args: &[&str]) -> (i32, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "60"])
        .args(args)
        .output()
        .expect("curl runs");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
    )
}

#[test]
fn tls_with_a_generated_certificate_verifies_with_cacert() {
    let dir = tempfile::tempdir().unwrap();
    let addr = common::start_daemon("[tls]\nmode = \"on\"\n", dir.path());
    let tls = dir.path().join("tls");
    let cert = tls.join("cert.pem");
    assert!(cert.exists() && tls.join("key.pem").exists());
    let key_mode = std::os::unix::fs::PermissionsExt::mode(
        &std::fs::metadata(tls.join("key.pem"))
            .unwrap()
            .permissions(),
    );
    assert_eq!(key_mode & 0o077, 0, "the key is private");
    let fingerprint = std::fs::read_to_string(tls.join("fingerprint")).unwrap();
    assert_eq!(fingerprint.trim().len(), 32 * 3 - 1, "{fingerprint}");

    let https = format!("https://127.0.0.1:{}/healthz", addr.port());
    let cacert = cert.to_str().unwrap();
    let (code, body) = curl(&["--cacert", cacert, "-D", "-", &https]);
    assert_eq!(code, 0, "{body}");
    assert!(body.starts_with("HTTP/1.1 200"), "{body}");
    assert!(
        body.to_ascii_lowercase()
            .contains("strict-transport-security: max-age=31536000"),
        "{body}"
    );
    assert!(body.contains("\"status\":\"ok\""), "{body}");
    // Without the certificate, curl refuses the self-signed server (exit 60).
    let (code, _) = curl(&[&https]);
    assert_eq!(code, 60);
    // Plain HTTP on the TLS port: a redirect to the same path over https.
    let http = format!("http://127.0.0.1:{}/console/?x=1", addr.port());
    let (code, head) = curl(&["-D", "-", "-o", "/dev/null", &http]);
    assert_eq!(code, 0);
    assert!(head.starts_with("HTTP/1.1 308"), "{head}");
    assert!(
        head.contains(&format!(
            "Location: https://127.0.0.1:{}/console/?x=1",
            addr.port()
        )),
        "{head}"
    );
    // The console's cookies are Secure over TLS.
    let signin = format!("https://127.0.0.1:{}/console/signin", addr.port());
    let (_, head) = curl(&["--cacert", cacert, "-D", "-", "-o", "/dev/null", &signin]);
    let cookie = head
        .lines()
        .find(|l| l.to_ascii_lowercase().starts_with("set-cookie:"))
        .unwrap_or_default();
    assert!(cookie.contains("; Secure"), "{head}");
    // An API call over TLS is authenticated as usual.
    let api = format!("https://127.0.0.1:{}/api/v1/collections", addr.port());
    let (_, status) = curl(&[
        "--cacert",
        cacert,
        "-o",
        "/dev/null",
        "-w",
        "%{http_code}",
        &api,
    ]);
    assert_eq!(status, "401");
}

#[test]
fn tls_is_automatic_beyond_loopback_and_a_bad_pair_is_refused() {
    use engram_server::{tls::TlsSetting, Overrides, RawConfig};
    let validate = |toml: &str, listen: &str| {
        let mut raw = RawConfig::parse(toml).unwrap();
        raw.apply_overrides(&Overrides {
            listen: Some(listen.into()),
            data_dir: None,
        });
        raw.validate()
    };
    assert_eq!(validate("", "127.0.0.1:8080").unwrap().tls, TlsSetting::Off);
    assert_eq!(
        validate("", "0.0.0.0:8080").unwrap().tls,
        TlsSetting::On(None)
    );
    let off = validate("[tls]\nmode = \"off\"\n", "0.0.0.0:8080").unwrap();
    assert_eq!(off.tls, TlsSetting::Off);
    let e = validate("[tls]\ncert = \"/x.pem\"\n", "0.0.0.0:8080").unwrap_err();
    assert!(e.to_string().contains("tls.cert"), "{e}");
    let e = validate("[tls]\nmode = \"yes\"\n", "0.0.0.0:8080").unwrap_err();
    assert!(e.to_string().contains("tls.mode"), "{e}");
    // A certificate file that is not one: a clear error at start.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("c.pem"), "not a certificate").unwrap();
    std::fs::write(dir.path().join("k.pem"), "not a key").unwrap();
    let files = (dir.path().join("c.pem"), dir.path().join("k.pem"));
    let err = engram_server::tls::load(Some(&files), dir.path(), "0.0.0.0:1".parse().unwrap())
        .err()
        .expect("refused");
    assert!(err.to_string().contains("c.pem"), "{err}");
}
