// llama.cpp's reference outputs for a golden file: for each prompt (given as token ids), the
// top-5 logits at the last prompt position and 32 greedy tokens with the top1-top2 logit margin
// at each step. Built and run by make-kquant-golden.sh against the llama.cpp that
// bench/llamacpp.sh builds; the settings are those of ../shared/golden's Q4_1 file: CPU only,
// 2 threads, flash attention off, f16 KV cache, n_ctx 4096, the prompt in llama_decode calls of
// at most 512 tokens with logits for the last position only, greedy argmax over the raw logits
// (ties to the lowest id), end-of-generation tokens not stopping the run.
//
//   kquant_golden MODEL.gguf PROMPTS.txt [N_GENERATE] [THREADS] [FLASH_ATTN] > OUT.jsonl
//
// FLASH_ATTN 1 turns flash attention on: not the golden setting, but llama.cpp's own other path,
// whose distance from the default one says how far float order alone moves these outputs.
// PROMPTS.txt: one prompt a line, `ID TOKEN TOKEN ...`. OUT.jsonl: one JSON object a line:
//   {"id", "top5": [[token, logit, "piece as hex"], ...], "generated": [...], "margins": [...],
//    "first_eog_index", "text_all_hex", "text_until_eog_hex"}
// then a last line {"system_info": "..."}. Text is hex-encoded bytes: a piece may be part of a
// UTF-8 character; the Python side decodes it.

#include "llama.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace {

// Settings of the Q4_1 golden file (its "settings" object).
constexpr int N_CTX = 4096;
constexpr int N_BATCH = 512;

[[noreturn]] void die(const std::string & msg) {
    std::fprintf(stderr, "kquant_golden: error: %s\n", msg.c_str());
    std::exit(1);
}

std::string hex(const std::string & bytes) {
    static const char * digits = "0123456789abcdef";
    std::string out;
    for (unsigned char c : bytes) {
        out += digits[c >> 4];
        out += digits[c & 15];
    }
    return out;
}

std::string piece(const llama_vocab * vocab, llama_token t) {
    char buf[256];
    int n = llama_token_to_piece(vocab, t, buf, sizeof buf, 0, true);
    if (n < 0) die("token piece longer than 256 bytes");
    return std::string(buf, n);
}

std::string detokenize(const llama_vocab * vocab, const std::vector<llama_token> & tokens) {
    std::string text(tokens.size() * 64 + 16, '\0');
    int n = llama_detokenize(vocab, tokens.data(), (int) tokens.size(), text.data(),
                             (int) text.size(), false, true);
    if (n < 0) die("detokenized text too long");
    text.resize(n);
    return text;
}

// Token ids ordered by logit, highest first, ties to the lowest id; the first `k`.
std::vector<llama_token> top_k(const float * logits, int n_vocab, int k) {
    std::vector<llama_token> ids(n_vocab);
    for (int i = 0; i < n_vocab; ++i) ids[i] = i;
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](llama_token a, llama_token b) {
        return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    ids.resize(k);
    return ids;
}

void quiet_log(ggml_log_level level, const char * text, void *) {
    if (level >= GGML_LOG_LEVEL_WARN) std::fputs(text, stderr);
}

}  // namespace

int main(int argc, char ** argv) {
    if (argc < 3) die("usage: kquant_golden MODEL.gguf PROMPTS.txt [N_GENERATE] [THREADS] [FLASH_ATTN]");
    const int n_generate = argc > 3 ? std::atoi(argv[3]) : 32;
    const int threads = argc > 4 ? std::atoi(argv[4]) : 2;
    const bool flash_attn = argc > 5 && std::atoi(argv[5]) != 0;

    llama_log_set(quiet_log, nullptr);
    llama_backend_init();
    llama_model_params mp = llama_model_default_params();
    mp.n_gpu_layers = 0;
    llama_model * model = llama_model_load_from_file(argv[1], mp);
    if (!model) die(std::string("cannot load ") + argv[1]);
    const llama_vocab * vocab = llama_model_get_vocab(model);
    const int n_vocab = llama_vocab_n_tokens(vocab);

    std::ifstream prompts(argv[2]);
    if (!prompts) die(std::string("cannot read ") + argv[2]);
    std::string line;
    while (std::getline(prompts, line)) {
        std::istringstream in(line);
        std::string id;
        if (!(in >> id)) continue;
        std::vector<llama_token> tokens;
        for (llama_token t; in >> t;) tokens.push_back(t);
        if (tokens.empty() || (int) tokens.size() + n_generate > N_CTX) die(id + ": bad prompt length");

        // A fresh context (empty KV cache) for every prompt.
        llama_context_params cp = llama_context_default_params();
        cp.n_ctx = N_CTX;
        cp.n_batch = N_BATCH;
        cp.n_ubatch = N_BATCH;
        cp.n_threads = threads;
        cp.n_threads_batch = threads;
        cp.flash_attn_type = flash_attn ? LLAMA_FLASH_ATTN_TYPE_ENABLED : LLAMA_FLASH_ATTN_TYPE_DISABLED;
        cp.no_perf = true;
        llama_context * ctx = llama_init_from_model(model, cp);
        if (!ctx) die(id + ": cannot create a context");

        // Prefill in batches of N_BATCH; llama_batch_get_one asks for the last token's logits.
        for (size_t at = 0; at < tokens.size(); at += N_BATCH) {
            int n = (int) std::min<size_t>(N_BATCH, tokens.size() - at);
            if (llama_decode(ctx, llama_batch_get_one(tokens.data() + at, n)) != 0) {
                die(id + ": prefill failed");
            }
        }

        std::vector<llama_token> generated;
        std::vector<double> margins;
        std::string top5;
        int first_eog = -1;
        for (int step = 0; step < n_generate; ++step) {
            const float * logits = llama_get_logits_ith(ctx, -1);
            if (!logits) die(id + ": no logits");
            std::vector<llama_token> best = top_k(logits, n_vocab, 5);
            if (step == 0) {
                for (llama_token t : best) {
                    char buf[64];
                    std::snprintf(buf, sizeof buf, "%.9g", logits[t]);
                    top5 += std::string(top5.empty() ? "" : ", ") + "[" + std::to_string(t) + ", " +
                            buf + ", \"" + hex(piece(vocab, t)) + "\"]";
                }
            }
            margins.push_back((double) logits[best[0]] - (double) logits[best[1]]);
            llama_token next = best[0];
            generated.push_back(next);
            if (first_eog < 0 && llama_vocab_is_eog(vocab, next)) first_eog = step;
            if (step + 1 < n_generate && llama_decode(ctx, llama_batch_get_one(&next, 1)) != 0) {
                die(id + ": decode failed");
            }
        }
        llama_free(ctx);

        std::vector<llama_token> until_eog(generated.begin(),
                                           first_eog < 0 ? generated.end() : generated.begin() + first_eog);
        std::printf("{\"id\": \"%s\", \"top5\": [%s], \"generated\": [", id.c_str(), top5.c_str());
        for (size_t i = 0; i < generated.size(); ++i) std::printf("%s%d", i ? ", " : "", generated[i]);
        std::printf("], \"margins\": [");
        for (size_t i = 0; i < margins.size(); ++i) std::printf("%s%.9g", i ? ", " : "", margins[i]);
        std::printf("], \"first_eog_index\": %s, \"text_all_hex\": \"%s\", \"text_until_eog_hex\": \"%s\"}\n",
                    first_eog < 0 ? "null" : std::to_string(first_eog).c_str(),
                    hex(detokenize(vocab, generated)).c_str(), hex(detokenize(vocab, until_eog)).c_str());
        std::fflush(stdout);
    }
    std::printf("{\"system_info\": \"%s\"}\n", llama_print_system_info());
    llama_model_free(model);
    llama_backend_free();
    return 0;
}
