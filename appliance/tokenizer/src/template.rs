//! Chat templates: the model's Jinja `tokenizer.chat_template`, rendered as Hugging Face does.
//!
//! Hugging Face renders with jinja2 (`trim_blocks`, `lstrip_blocks`, Python string methods, its
//! own `tojson` and `raise_exception`, and `strftime_now`); minijinja with `pycompat` gives the
//! same output for the templates models ship.

use std::time::{SystemTime, UNIX_EPOCH};

use engram_gguf::Metadata;
use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::error::{Result, TokenizerError};
use crate::vocab::{opt_str, KEY_BOS, KEY_EOS, KEY_TOKENS};

/// The metadata key holding the template source.
pub const KEY_CHAT_TEMPLATE: &str = "tokenizer.chat_template";

const TEMPLATE_NAME: &str = "chat_template";

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    /// "system", "user", "assistant" or "tool".
    pub role: String,
    pub content: String,
}

impl Message {
    /// A message with `role` and `content`.
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Message {
            role: role.into(),
            content: content.into(),
        }
    }
}

/// A compiled chat template and the BOS/EOS texts it may refer to.
#[derive(Clone, Debug)]
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// The template stored in the file, with BOS/EOS texts from its vocabulary; `None` when the
    /// file has no template.
    pub fn from_gguf(meta: &Metadata) -> Result<Option<ChatTemplate>> {
        let Some(source) = opt_str(meta, KEY_CHAT_TEMPLATE)? else {
            return Ok(None);
        };
        let token_text = |key: &str| -> Result<String> {
            let Some(id) = meta.opt(key, Metadata::get_u64)? else {
                return Ok(String::new());
            };
            let tokens = meta.get_array(KEY_TOKENS)?;
            Ok(usize::try_from(id)
                .ok()
                .and_then(|i| tokens.get(i))
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_owned())
        };
        let bos = token_text(KEY_BOS)?;
        let eos = token_text(KEY_EOS)?;
        ChatTemplate::new(source, &bos, &eos).map(Some)
    }

    /// Compiles `source`; a syntax error is reported here, not at render time.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.to_owned())
            .map_err(|e| TokenizerError::TemplateSyntax {
                message: describe(&e),
            })?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
        })
    }

    /// Renders `messages`; `add_generation_prompt` appends the opening of an assistant turn.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// Renders with a `tools` list (JSON schemas, as in the OpenAI API) for templates that
    /// support tool calling.
    pub fn render_with_tools(
        &self,
        messages: &[Message],
        tools: Option<&serde_json::Value>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template =
            self.env
                .get_template(TEMPLATE_NAME)
                .map_err(|e| TokenizerError::TemplateRender {
                    message: describe(&e),
                })?;
        let ctx = minijinja::context! {
            messages => Value::from_serialize(messages),
            tools => tools.map(Value::from_serialize),
            documents => Value::from(()),
            add_generation_prompt => add_generation_prompt,
            bos_token => self.bos_token.as_str(),
            eos_token => self.eos_token.as_str(),
        };
        template
            .render(ctx)
            .map_err(|e| TokenizerError::TemplateRender {
                message: describe(&e),
            })
    }

    /// The BOS text the template sees as `bos_token`.
    pub fn bos_token(&self) -> &str {
        &self.bos_token
    }

    /// The EOS text the template sees as `eos_token`.
    pub fn eos_token(&self) -> &str {
        &self.eos_token
    }
}

/// A minijinja error with its detail and source chain on one line.
fn describe(e: &minijinja::Error) -> String {
    let mut msg = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(s) = source {
        msg.push_str(": ");
        msg.push_str(&s.to_string());
        source = s.source();
    }
    msg
}

/// `raise_exception(message)`: templates call it to reject a conversation.
fn raise_exception(message: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
}

/// `x | tojson(indent=None, sort_keys=False, ensure_ascii=False)`, formatted like Python's
/// `json.dumps` (", " and ": " separators), which is what Hugging Face's filter calls.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<Value, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| minijinja::Error::new(ErrorKind::BadSerialization, "tojson").with_source(e))?;
    let mut out = String::new();
    let style = PyJson {
        indent,
        sort_keys: sort_keys.unwrap_or(false),
        ensure_ascii: ensure_ascii.unwrap_or(false),
    };
    style.write(&json, 0, &mut out);
    Ok(Value::from_safe_string(out))
}

/// Python `json.dumps` formatting options.
struct PyJson {
    indent: Option<usize>,
    sort_keys: bool,
    ensure_ascii: bool,
}

impl PyJson {
    fn newline(&self, level: usize, out: &mut String) {
        if let Some(n) = self.indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * level));
        }
    }

    fn item_separator(&self) -> &'static str {
        if self.indent.is_some() {
            ","
        } else {
            ", "
        }
    }

    fn string(&self, s: &str, out: &mut String) {
        let quoted = serde_json::to_string(s).expect("strings serialize");
        if !self.ensure_ascii {
            out.push_str(&quoted);
            return;
        }
        for c in quoted.chars() {
            if c.is_ascii() {
                out.push(c);
            } else {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
        }
    }

    fn write(&self, v: &serde_json::Value, level: usize, out: &mut String) {
        use serde_json::Value as J;
        match v {
            J::Null => out.push_str("null"),
            J::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            J::Number(n) => out.push_str(&n.to_string()),
            J::String(s) => self.string(s, out),
            J::Array(items) if items.is_empty() => out.push_str("[]"),
            J::Array(items) => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_separator());
                    }
                    self.newline(level + 1, out);
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push(']');
            }
            J::Object(map) if map.is_empty() => out.push_str("{}"),
            J::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(self.item_separator());
                    }
                    self.newline(level + 1, out);
                    self.string(k, out);
                    out.push_str(": ");
                    self.write(item, level + 1, out);
                }
                self.newline(level, out);
                out.push('}');
            }
        }
    }
}

/// `strftime_now(format)`: the current UTC time, for templates that print today's date.
fn strftime_now(format: String) -> String {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    strftime(secs, &format)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats Unix time `secs` (UTC) with the common C `strftime` directives; others are kept
/// as written.
fn strftime(secs: u64, format: &str) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    let (hour, minute, second) = (rem / 3600, rem % 3600 / 60, rem % 60);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_march = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_march + 2) / 153;
    let day = doy_march - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let month_name = MONTHS[(month - 1) as usize];

    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year % 100)),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:>2}")),
            Some('j') => out.push_str(&format!("{yday:03}")),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(WEEKDAYS[weekday]),
            Some('a') => out.push_str(&WEEKDAYS[weekday][..3]),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml() {
        let t = ChatTemplate::new(CHATML, "", "").unwrap();
        let out = t.render(&[Message::new("user", "hi")], true).unwrap();
        assert_eq!(
            out,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
        let out = t.render(&[Message::new("user", "hi")], false).unwrap();
        assert_eq!(out, "<|im_start|>user\nhi<|im_end|>\n");
    }

    #[test]
    fn bad_syntax_is_an_error_not_a_panic() {
        let err = ChatTemplate::new("{% for m in messages %}{{ m.content }", "", "").unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateSyntax { .. }),
            "{err}"
        );
        let err = ChatTemplate::new("{% if %}", "", "").unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateSyntax { .. }),
            "{err}"
        );
    }

    #[test]
    fn raise_exception_is_a_render_error_with_its_message() {
        let t = ChatTemplate::new(
            "{% if messages[0].role != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}",
            "",
            "",
        )
        .unwrap();
        let err = t
            .render(&[Message::new("assistant", "x")], true)
            .unwrap_err();
        assert!(
            matches!(err, TokenizerError::TemplateRender { .. }),
            "{err}"
        );
        assert!(
            err.to_string()
                .contains("first message must be from the user"),
            "{err}"
        );
    }

    #[test]
    fn trim_and_lstrip_blocks_like_jinja2() {
        let t = ChatTemplate::new(
            "{% for m in messages %}\n    {% if m.role == 'user' %}\nU:{{ m.content }}\n    {% endif %}\n{% endfor %}\n",
            "",
            "",
        )
        .unwrap();
        let out = t
            .render(
                &[Message::new("user", "a"), Message::new("user", "b")],
                false,
            )
            .unwrap();
        assert_eq!(out, "U:a\nU:b\n");
    }

    #[test]
    fn python_string_methods_and_bos() {
        let t = ChatTemplate::new(
            "{{ bos_token }}{% for m in messages %}{{ m.content.strip().upper() }}{% if m.content.startswith(' x') %}!{% endif %}{% endfor %}{{ eos_token }}",
            "<s>",
            "</s>",
        )
        .unwrap();
        let out = t.render(&[Message::new("user", " xy ")], false).unwrap();
        assert_eq!(out, "<s>XY!</s>");
    }

    #[test]
    fn tojson_matches_python_json_dumps() {
        let t = ChatTemplate::new(
            "{{ tools | tojson }}|{{ tools[0] | tojson(indent=2) }}|{{ 'é<' | tojson }}|{{ 'é' | tojson(ensure_ascii=true) }}",
            "",
            "",
        )
        .unwrap();
        let tools = serde_json::json!([{"name": "f", "parameters": {"a": [1, 2], "b": {}}}]);
        let out = t.render_with_tools(&[], Some(&tools), false).unwrap();
        assert_eq!(
            out,
            "[{\"name\": \"f\", \"parameters\": {\"a\": [1, 2], \"b\": {}}}]|{\n  \"name\": \"f\",\n  \"parameters\": {\n    \"a\": [\n      1,\n      2\n    ],\n    \"b\": {}\n  }\n}|\"é<\"|\"\\u00e9\""
        );
        // Without tools, `tools` is none, as Hugging Face passes it.
        let t =
            ChatTemplate::new("{% if tools is not none %}T{% else %}N{% endif %}", "", "").unwrap();
        assert_eq!(t.render(&[], false).unwrap(), "N");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-02-29 13:05:09 UTC, a Thursday.
        let t = 1_709_211_909;
        assert_eq!(strftime(t, "%d %b %Y"), "29 Feb 2024");
        assert_eq!(
            strftime(t, "%Y-%m-%d %H:%M:%S %A %j %p %I %%"),
            "2024-02-29 13:05:09 Thursday 060 PM 01 %"
        );
        assert_eq!(strftime(0, "%a %B %e %y"), "Thu January  1 70");
        let today = ChatTemplate::new("{{ strftime_now('%Y') }}", "", "").unwrap();
        assert!(today.render(&[], false).unwrap().starts_with("20"));
    }
}
