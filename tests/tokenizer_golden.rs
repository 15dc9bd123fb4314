//! Tokenizer and chat template of the default model against llama.cpp's golden outputs.
//!
//! Every id must match exactly: a single differing id changes the KV cache Engram stores.

use std::sync::OnceLock;

use engram_gguf::GgufFile;
use engram_tokenizer::{ChatTemplate, Message, Tokenizer};
use serde_json::Value;

use crate::common::{self, ids};

struct Fixture {
    tokenizer: Tokenizer,
    template: ChatTemplate,
    golden: Value,
}

/// Loaded once and shared by the tests of this module.
fn fixture() -> &'static Fixture {
    static FIXTURE: OnceLock<Fixture> = OnceLock::new();
    FIXTURE.get_or_init(|| {
        let file = GgufFile::open(common::default_llm()).expect("default model opens");
        let tokenizer = Tokenizer::from_gguf(file.metadata()).expect("tokenizer builds");
        let template = ChatTemplate::from_gguf(file.metadata())
            .expect("template compiles")
            .expect("default model has a chat template");
        Fixture {
            tokenizer,
            template,
            golden: common::smollm2_golden(),
        }
    })
}

fn messages(v: &Value) -> Vec<Message> {
    serde_json::from_value(v.clone()).expect("messages are {role, content}")
}

/// Each id with the text it decodes to, for mismatch reports.
fn show(t: &Tokenizer, ids: &[u32]) -> String {
    ids.iter()
        .map(|&id| format!("{id}:{:?}", String::from_utf8_lossy(&t.token_bytes(id))))
        .collect::<Vec<_>>()
        .join(" ")
}

/// `None` when equal, otherwise a readable report around the first differing index.
fn id_diff(t: &Tokenizer, label: &str, got: &[u32], want: &[u32]) -> Option<String> {
    if got == want {
        return None;
    }
    let first = got
        .iter()
        .zip(want)
        .position(|(a, b)| a != b)
        .unwrap_or(got.len().min(want.len()));
    let lo = first.saturating_sub(3);
    let window = |v: &[u32]| v[lo.min(v.len())..(first + 5).min(v.len())].to_vec();
    Some(format!(
        "{label}: ids differ at index {first} (got {} ids, want {})\n  got  [{lo}..]: {}\n  want [{lo}..]: {}",
        got.len(),
        want.len(),
        show(t, &window(got)),
        show(t, &window(want)),
    ))
}

/// A readable report of two differing strings.
fn text_diff(label: &str, got: &str, want: &str) -> Option<String> {
    if got == want {
        return None;
    }
    let first = got
        .char_indices()
        .zip(want.chars())
        .find(|((_, a), b)| a != b)
        .map_or(got.len().min(want.len()), |((i, _), _)| i);
    let ctx = |s: &str| {
        let start = s.floor_char_boundary(first.saturating_sub(20));
        let end = s.ceil_char_boundary((first + 40).min(s.len()));
        format!("{:?}", &s[start..end])
    };
    Some(format!(
        "{label}: texts differ at byte {first}\n  got:  {}\n  want: {}",
        ctx(got),
        ctx(want)
    ))
}

fn report(failures: Vec<String>, total: usize) {
    assert!(
        failures.is_empty(),
        "{} of {total} cases failed:\n\n{}",
        failures.len(),
        failures.join("\n\n")
    );
}

#[test]
fn prompt_token_ids_match_llama_cpp() {
    let f = fixture();
    let prompts = f.golden["prompts"].as_array().expect("prompts");
    assert!(!prompts.is_empty());
    let mut failures = Vec::new();
    for p in prompts {
        let id = p["id"].as_str().unwrap_or("?");
        let text = p["prompt_text"].as_str().expect("prompt_text");
        let got = f.tokenizer.encode(text, true).expect("encode");
        failures.extend(id_diff(
            &f.tokenizer,
            id,
            &got,
            &ids(&p["prompt_token_ids"]),
        ));
    }
    report(failures, prompts.len());
}

#[test]
fn edge_cases_match_llama_cpp_in_both_modes() {
    let f = fixture();
    let cases = f.golden["tokenizer_edge_cases"]
        .as_array()
        .expect("edge cases");
    assert!(!cases.is_empty());
    let mut failures = Vec::new();
    for case in cases {
        let text = case["text"].as_str().expect("text");
        for (parse_special, key) in [(true, "ids_parse_special"), (false, "ids_no_parse_special")] {
            let got = f.tokenizer.encode(text, parse_special).expect("encode");
            let label = format!("{text:?} (parse_special={parse_special})");
            failures.extend(id_diff(&f.tokenizer, &label, &got, &ids(&case[key])));
        }
    }
    report(failures, cases.len() * 2);
}

#[test]
fn chat_template_renders_every_prompt_text() {
    let f = fixture();
    let prompts = f.golden["prompts"].as_array().expect("prompts");
    let mut failures = Vec::new();
    for p in prompts {
        let id = p["id"].as_str().unwrap_or("?");
        let rendered = f
            .template
            .render(&messages(&p["messages"]), true)
            .expect("render");
        failures.extend(text_diff(id, &rendered, p["prompt_text"].as_str().unwrap()));
    }
    report(failures, prompts.len());
}

#[test]
fn decode_round_trips_edge_cases() {
    let f = fixture();
    let mut failures = Vec::new();
    let cases = f.golden["tokenizer_edge_cases"]
        .as_array()
        .expect("edge cases");
    for case in cases {
        let text = case["text"].as_str().expect("text");
        for parse_special in [true, false] {
            let ids = f.tokenizer.encode(text, parse_special).expect("encode");
            let label = format!("decode(encode({text:?}, {parse_special}))");
            failures.extend(text_diff(&label, &f.tokenizer.decode(&ids, false), text));
            // Streaming gives the same text.
            let mut d = engram_tokenizer::Detokenizer::new(&f.tokenizer, false);
            let streamed: String = ids.iter().map(|&id| d.push(id)).collect();
            failures.extend(text_diff(&format!("streamed {label}"), &streamed, text));
        }
    }
    report(failures, cases.len() * 2);
}

#[test]
fn eog_ids_and_special_ids_match_llama_cpp() {
    let f = fixture();
    let want = ids(&f.golden["settings"]["eog_token_ids"]);
    assert_eq!(f.tokenizer.eog_ids(), want.as_slice());
    assert!(!f.tokenizer.add_bos(), "the golden says no BOS is added");
    assert_eq!(f.tokenizer.vocab_size(), 49152);
    assert_eq!(f.tokenizer.pre_tokenizer(), "smollm");
    let im_end = f
        .tokenizer
        .token_id("<|im_end|>")
        .expect("<|im_end|> exists");
    assert!(f.tokenizer.is_eog(im_end));
    // The golden's generated text decodes from its generated ids.
    for p in f.golden["prompts"].as_array().expect("prompts") {
        let generated = ids(&p["generated_token_ids"]);
        let text = f.tokenizer.decode(&generated, false);
        if let Some(d) = text_diff(
            "generated_text_all32",
            &text,
            p["generated_text_all32"].as_str().unwrap(),
        ) {
            panic!("{}: {d}", p["id"]);
        }
    }
}

const QWEN2_TEMPLATE: &str = "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- messages[0]['content'] }}\n    {%- else %}\n        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n        {{- \"\\n\" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or (message.role == \"assistant\" and not message.tool_calls) %}\n        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}\n        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n";

const LLAMA3_TEMPLATE: &str = "{{- bos_token }}\n{%- if custom_tools is defined %}\n    {%- set tools = custom_tools %}\n{%- endif %}\n{%- if not tools_in_user_message is defined %}\n    {%- set tools_in_user_message = true %}\n{%- endif %}\n{%- if not date_string is defined %}\n    {%- set date_string = \"26 Jul 2024\" %}\n{%- endif %}\n{%- if not tools is defined %}\n    {%- set tools = none %}\n{%- endif %}\n\n{#- This block extracts the system message, so we can slot it into the right place. #}\n{%- if messages[0]['role'] == 'system' %}\n    {%- set system_message = messages[0]['content']|trim %}\n    {%- set messages = messages[1:] %}\n{%- else %}\n    {%- set system_message = \"\" %}\n{%- endif %}\n\n{#- System message + builtin tools #}\n{{- \"<|start_header_id|>system<|end_header_id|>\\n\\n\" }}\n{{- \"Cutting Knowledge Date: December 2023\\n\" }}\n{{- \"Today Date: \" + date_string + \"\\n\\n\" }}\n{{- system_message }}\n{{- \"<|eot_id|>\" }}\n\n{%- for message in messages %}\n    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}\n        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}\n    {%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}\n    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}\n{%- endif %}\n";

#[test]
fn qwen2_and_llama3_style_templates_render() {
    let qwen =
        ChatTemplate::new(QWEN2_TEMPLATE, "", "<|im_end|>").expect("qwen2 template compiles");
    let msgs = [
        Message::new("user", "Hi"),
        Message::new("assistant", "Hello!"),
        Message::new("user", "Bye"),
    ];
    assert_eq!(
        qwen.render(&msgs, true).unwrap(),
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n\
         <|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n\
         <|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n"
    );
    let tools = serde_json::json!([{"type": "function", "function": {"name": "now"}}]);
    let with_tools = qwen
        .render_with_tools(&msgs[..1], Some(&tools), true)
        .unwrap();
    // Key order follows serde_json's map (sorted unless `preserve_order` is on), so only the
    // Python-style separators are checked.
    assert!(
        with_tools.contains("<tools>\n{\"") && with_tools.contains("{\"name\": \"now\"}"),
        "{with_tools}"
    );

    let llama = ChatTemplate::new(LLAMA3_TEMPLATE, "<|begin_of_text|>", "<|eot_id|>")
        .expect("llama3 template compiles");
    let msgs = [
        Message::new("system", "  Be brief.  "),
        Message::new("user", "Hi "),
    ];
    assert_eq!(
        llama.render(&msgs, true).unwrap(),
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n\
         Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n\
         Be brief.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>\
         <|start_header_id|>assistant<|end_header_id|>\n\n"
    );
}
