//! Languages: every string of the console comes from a catalog (`web/i18n/<lang>.toml`,
//! compiled in); the language is the `engram_lang` cookie's, else the best of the browser's
//! `Accept-Language`, else English.

use std::collections::BTreeMap;
use std::sync::LazyLock;

/// The cookie that remembers the language switch.
pub const LANG_COOKIE: &str = "engram_lang";

/// A language the console speaks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lang {
    En,
    ZhCn,
}

impl Lang {
    pub const ALL: [Lang; 2] = [Lang::En, Lang::ZhCn];

    /// The BCP 47 tag (also the `lang` attribute and the cookie value).
    pub fn tag(self) -> &'static str {
        match self {
            Lang::En => "en",
            Lang::ZhCn => "zh-CN",
        }
    }

    pub fn from_tag(tag: &str) -> Option<Lang> {
        let t = tag.trim().to_ascii_lowercase();
        if t == "en" || t.starts_with("en-") {
            Some(Lang::En)
        } else if t == "zh" || t.starts_with("zh-") {
            Some(Lang::ZhCn)
        } else {
            None
        }
    }

    /// The best language of an `Accept-Language` value (by q-value, then order).
    pub fn negotiate(accept: &str) -> Option<Lang> {
        let mut best: Option<(f32, Lang)> = None;
        for part in accept.split(',') {
            let mut it = part.split(';');
            let tag = it.next().unwrap_or("");
            let q = it
                .find_map(|p| p.trim().strip_prefix("q="))
                .and_then(|q| q.parse::<f32>().ok())
                .unwrap_or(1.0);
            if let Some(l) = Lang::from_tag(tag) {
                if q > 0.0 && best.is_none_or(|(bq, _)| q > bq) {
                    best = Some((q, l));
                }
            }
        }
        best.map(|(_, l)| l)
    }

    pub fn catalog(self) -> &'static Catalog {
        match self {
            Lang::En => &EN,
            Lang::ZhCn => &ZH_CN,
        }
    }
}

/// One language's strings, by dotted key (`nav.dashboard`).
pub struct Catalog {
    pub lang: Lang,
    strings: BTreeMap<String, String>,
}

/// The catalog sources, compiled in.
pub const EN_SOURCE: &str = include_str!("../../../../web/i18n/en.toml");
pub const ZH_CN_SOURCE: &str = include_str!("../../../../web/i18n/zh-CN.toml");

static EN: LazyLock<Catalog> = LazyLock::new(|| Catalog::parse(Lang::En, EN_SOURCE));
static ZH_CN: LazyLock<Catalog> = LazyLock::new(|| Catalog::parse(Lang::ZhCn, ZH_CN_SOURCE));

fn flatten(prefix: &str, table: &toml::Table, out: &mut BTreeMap<String, String>) {
    for (k, v) in table {
        let key = if prefix.is_empty() {
            k.clone()
        } else {
            format!("{prefix}.{k}")
        };
        match v {
            toml::Value::Table(t) => flatten(&key, t, out),
            toml::Value::String(s) => {
                out.insert(key, s.clone());
            }
            other => panic!("catalog key {key}: expected a string, found {other:?}"),
        }
    }
}

impl Catalog {
    /// Parses a catalog; a broken catalog is a build defect, caught by the unit tests.
    pub fn parse(lang: Lang, source: &str) -> Catalog {
        let table: toml::Table =
            toml::from_str(source).unwrap_or_else(|e| panic!("catalog {}: {e}", lang.tag()));
        let mut strings = BTreeMap::new();
        flatten("", &table, &mut strings);
        Catalog { lang, strings }
    }

    /// The string for `key`; the key itself when missing (visible, and caught by tests).
    pub fn get<'a>(&'a self, key: &'a str) -> &'a str {
        self.strings.get(key).map_or(key, String::as_str)
    }

    /// The string for `key` with `{}` replaced by `arg`.
    pub fn fmt(&self, key: &str, arg: impl std::fmt::Display) -> String {
        self.get(key).replacen("{}", &arg.to_string(), 1)
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.strings.keys().map(String::as_str)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn negotiates() {
        assert_eq!(Lang::negotiate("zh-CN,zh;q=0.9,en;q=0.8"), Some(Lang::ZhCn));
        assert_eq!(Lang::negotiate("en-US,en;q=0.9"), Some(Lang::En));
        assert_eq!(Lang::negotiate("fr, zh;q=0.5, en;q=0.7"), Some(Lang::En));
        assert_eq!(Lang::negotiate("de"), None);
    }

    #[test]
    fn catalogs_parse_and_agree() {
        let en: Vec<_> = Lang::En.catalog().keys().collect();
        let zh: Vec<_> = Lang::ZhCn.catalog().keys().collect();
        assert_eq!(en, zh, "en.toml and zh-CN.toml must have the same keys");
    }

    /// Every `t.get("...")` / `t.fmt("...", ...)` key in the templates exists.
    #[test]
    fn templates_use_known_keys() {
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../web/templates");
        let en = Lang::En.catalog();
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let text = std::fs::read_to_string(&path).unwrap();
            for pat in ["t.get(\"", "t.fmt(\""] {
                for (at, _) in text.match_indices(pat) {
                    let rest = &text[at + pat.len()..];
                    let key = &rest[..rest.find('"').unwrap()];
                    assert!(
                        en.strings.contains_key(key),
                        "{}: unknown catalog key `{key}`",
                        path.display()
                    );
                }
            }
        }
    }

    /// Every kind of document failure the console names has its sentence in both catalogs.
    #[test]
    fn failures_are_explained() {
        for lang in Lang::ALL {
            for kind in crate::console::pages::documents::FAILURES {
                let key = format!("failure.{kind}");
                assert!(
                    lang.catalog().strings.contains_key(&key),
                    "{}: {key}",
                    lang.tag()
                );
            }
        }
    }
}
