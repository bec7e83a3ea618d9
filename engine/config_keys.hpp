// Every key of the config, written once: its section, name, member, the values it
// allows and a one-line doc (markdown). Three visitors walk these lists
// (engine/config.cpp): the reader (type and range checks, unknown keys), the writer
// of the config.toml a checkpoint stores, and the reference table of
// engine/README.md ("Configuration", printed by `spes-engine reference config`).
// A key's default is its member's initial value (engine/config.hpp,
// model/model_config.hpp).
//
// A visitor V has
//   section(name, body)                       [name]; body() visits its keys
//   integer(key, member, lo, hi, doc)         int64_t in [lo, hi]
//   unsigned_integer(key, member, doc)        uint64_t in [0, int64 max]
//   real(key, member, Interval, doc)          finite double in the interval
//   integer_list(key, member, lo, hi, doc)    std::vector<int64_t>, each in [lo, hi]
//   boolean(key, member, doc)
//   string(key, member, doc)
//   path(key, member, doc)                    a string; relative = to the config's folder
//   choice(key, member, names, doc)           an enum, spelled as in its EnumName table
// The reader reads the keys in this order and names them in this order when a key
// is unknown; the writer writes them in this order.
#pragma once
#include <cmath>
#include <cstdint>
#include <limits>

#include "engine/config.hpp"

namespace spes::config_keys {

constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

// A range of reals; an open end excludes its bound.
struct Interval {
  double lo, hi;
  bool lo_open = false, hi_open = false;
};
constexpr Interval closed(double lo, double hi) { return {lo, hi}; }
constexpr Interval closed_open(double lo, double hi) { return {lo, hi, false, true}; }
constexpr Interval open_closed(double lo, double hi) { return {lo, hi, true, false}; }
constexpr double kInf = INFINITY;

// M is the section's struct, const for the writer.
template <class V, class M>
void model_keys(V& v, M& m) {
  v.integer("vocab_size", m.vocab_size, 2, int64_t(1) << 31, "vocabulary (256 = built-in byte tokenizer)");
  v.integer("d_model", m.d_model, 2, 65536, "model width; a multiple of `n_heads` with `d_model / n_heads` even (RoPE)");
  v.integer("n_layers", m.n_layers, 1, 1024, "transformer layers");
  v.integer("n_heads", m.n_heads, 1, 1024, "attention heads; a multiple of `n_kv_heads`");
  v.integer("n_kv_heads", m.n_kv_heads, 1, 1024, "key/value heads; `n_kv_heads < n_heads` is GQA");
  v.integer("n_experts", m.n_experts, 1, 4096, "MoE experts per layer");
  v.integer("top_k", m.top_k, 1, 4096, "experts per token, at most `n_experts`");
  v.integer("expert_hidden", m.expert_hidden, 1, 1 << 20, "SwiGLU hidden size of an expert");
  v.integer("seq_len", m.seq_len, 1, 1 << 20, "training context (exported as `max_position_embeddings`)");
  v.real("rope_theta", m.rope_theta, open_closed(0, kInf), "RoPE base (rotate_half / NeoX convention)");
  v.boolean("qk_norm", m.qk_norm, "RMSNorm over the whole q and k projections (OLMoE, OLMo-2)");
  v.boolean("qk_norm_per_head", m.qk_norm_per_head,
            "with `qk_norm`: RMSNorm over each head's `head_dim` channels, one weight shared by the heads (Qwen3)");
  v.integer("head_dim", m.head_dim_key, 0, 4096,
            "channels per attention head; 0 = `d_model / n_heads`; q is `n_heads·head_dim` wide (Qwen3 sets it)");
  v.boolean("post_norm", m.post_norm,
            "OLMo-2 norm placement: RMSNorm on the attention and MLP outputs before each residual add, none on "
            "their inputs (`post_attention_layernorm`, `post_feedforward_layernorm`)");
  v.real("norm_eps", m.norm_eps, open_closed(0, 1), "RMSNorm epsilon");
  v.boolean("norm_topk_prob", m.norm_topk_prob, "renormalise the top-k router weights");
  v.boolean("tie_embeddings", m.tie_embeddings, "share the embedding with `lm_head`");
  v.real("init_std", m.init_std, open_closed(0, 1), "truncated-normal (±3σ) init std; norms start at 1");
}

template <class V, class T>
void train_keys(V& v, T& t) {
  v.choice("device", t.device, kDeviceNames,
           "\"auto\": the GPU when one works and the model's shape runs there, else the CPU (said on stderr)");
  v.unsigned_integer("seed", t.seed,
                     "init seed (same on every node) and data seed base (node seed = seed + 1000·node_id)");
  v.integer("steps", t.steps, 1, kMaxInt, "optimizer steps of the run");
  v.integer("micro_batch", t.micro_batch, 1, 1 << 20, "sequences per forward/backward");
  v.integer("global_batch", t.global_batch, 1, 1 << 24,
            "sequences per optimizer step (gradient accumulation); a multiple of `micro_batch`");
  v.integer("threads", t.threads, 0, 4096, "CPU threads (0 = all cores)");
  v.integer_list("gpus", t.gpus, 0, 1023,
                 "the GPUs of this node, e.g. `[0, 1]` (empty: every visible GPU); several = data parallel, each "
                 "running `micro_batch / gpus` sequences");
  v.integer("eval_every", t.eval_every, 0, kMaxInt, "steps between validation evals (0 = only at the end)");
  v.integer("eval_batches", t.eval_batches, 0, 1 << 20, "micro-batches per eval (0 = all)");
  v.integer("max_steps_this_run", t.max_steps_this_run, 0, kMaxInt,
            "stop (with a checkpoint) after this many steps of this invocation; 0 = no limit");
  v.path("init", t.init,
         "a checkpoint (folder or root) whose parameters are θ at the start of a fresh run (step 0, fresh optimizer "
         "state), e.g. an `upcycle` output; the nodes and the coordinator all load it, so every machine needs the "
         "same file (`--resume` from a checkpoint does not read it). Its model must have this config's shape (vocab, "
         "d_model, layers, heads, head_dim, experts, expert_hidden, qk_norm and its options, post_norm, tying): else one line naming the key and both "
         "values. \"\" = the seeded init");
  v.real("lb_coef", t.loss.lb_coef, closed(0, kInf), "load-balancing loss coefficient");
  v.real("router_z_coef", t.loss.router_z_coef, closed(0, kInf), "router z-loss coefficient");
  v.real("lm_z_coef", t.loss.lm_z_coef, closed(0, kInf), "lm-head z-loss coefficient");
  v.boolean("decayed_aux_loss", t.loss.decayed_aux_loss,
            "SPES's decayed aux loss for owned experts ([README, Architecture: Loss](../README.md#loss))");
}

template <class V, class O>
void optim_keys(V& v, O& o) {
  v.real("lr", o.lr, open_closed(0, 10), "AdamW peak learning rate");
  v.real("beta1", o.beta1, closed_open(0, 1), "AdamW β1");
  v.real("beta2", o.beta2, closed_open(0, 1), "AdamW β2");
  v.real("eps", o.eps, open_closed(0, 1), "AdamW ε");
  v.real("weight_decay", o.weight_decay, closed(0, 10), "decoupled weight decay");
  v.boolean("decay_norms_and_embeddings", o.decay_norms_and_embeddings,
            "also decay norms and embeddings (SPES decays everything)");
  v.integer("warmup_steps", o.warmup_steps, 0, kMaxInt, "linear warmup steps");
  v.integer("decay_steps", o.decay_steps, 1, kMaxInt, "cosine decay to `lr·lr_floor` ends at this step; flat after");
  v.real("lr_floor", o.lr_floor, closed(0, 1), "the learning-rate floor as a fraction of `lr`");
  v.real("grad_clip", o.grad_clip, closed(0, kInf), "global-norm clipping (0 = off)");
}

template <class V, class D>
void data_keys(V& v, D& d) {
  v.path("train", d.train, "training manifest (required)");
  v.path("validation", d.validation, "validation manifest; \"\" = hold out `val_fraction` of the training data");
  v.real("val_fraction", d.val_fraction, closed(0, 0.5),
         "hold out this fraction of training instances (the same ones on every node)");
  v.choice("token_dtype", d.token_dtype, kTokenDtypeNames, "the width of the token files' ids");
  // Not a path key: "bytes" names the built-in tokenizer (the reader resolves any other value).
  v.string("tokenizer", d.tokenizer,
           "the tokenizer the data was made with: \"bytes\" or a `tokenizer.json` path; `train` and `local` then "
           "check `[model] vocab_size` ≥ its vocabulary (larger is padding) and that `token_dtype` holds its ids; "
           "\"\" = not declared, no check");
}

template <class V, class S>
void spes_keys(V& v, S& s) {
  v.integer("node_id", s.node_id, 0, 1 << 16, "this node, below `n_nodes`");
  v.integer("n_nodes", s.n_nodes, 1, 1 << 16, "number of nodes");
  v.choice("ownership", s.ownership, kOwnershipModeNames,
           "partitioned: each node owns k experts; all: every node owns every expert (centralized / DiLoCo "
           "baseline); which ones: [README, Architecture: Ownership](../README.md#ownership)");
  v.integer("experts_per_node", s.experts_per_node, 0, 4096, "k (0 = n_experts / n_nodes; larger replicates experts)");
  v.integer("sync_steps", s.sync_steps, 0, kMaxInt,
            "optimizer steps between sync rounds (0 = no sync; the coordinator needs ≥ 1: round r is step r × "
            "sync_steps)");
  v.string("run_id", s.run_id, "names the run; a node of another run is refused");
  v.string("coordinator", s.coordinator, "host:port the coordinator binds and the nodes dial");
  v.string("status_bind", s.status_bind,
           "host:port of the coordinator's read-only status page, `/metrics` and `/status.json` (port 0: a free "
           "one; the URL is logged at start; \"\" = off); off loopback only as the sync port may ([net/README.md, "
           "Watching a run](../net/README.md#watching-a-run))");
  v.choice("codec", s.codec, net::kCodecNames,
           "how deltas travel ([net/README.md, Codecs](../net/README.md#codecs))");
  v.boolean("overlap", s.overlap,
            "overlapped rounds: at a round the node pushes and trains on; the merged θ is applied `overlap_steps` "
            "later (or before a checkpoint / at the end of the run) keeping the progress since the push "
            "([net/README.md, Overlapped rounds](../net/README.md#overlapped-rounds)); the step loop waits only when a "
            "round has not arrived by then (said on stderr). What it costs in quality: [bench/RESULTS.md, "
            "Links](../bench/RESULTS.md#links-codecs-overlap-and-the-planner-issue-32); `spes-engine plan --link` "
            "says when it is worth it");
  v.integer("overlap_steps", s.overlap_steps, 0, kMaxInt,
            "with `overlap`: optimizer steps from a push to applying its round, below `sync_steps` (0 = at the next "
            "round); as few as the link allows: a round is stale for that long");
  v.path("secret_file", s.secret_file,
         "file holding the shared secret (else `$SPES_SECRET`); at least 16 non-blank bytes");
  v.boolean("allow_insecure", s.allow_insecure,
            "allow plaintext without a secret or TLS off loopback (a coordinator binding, or a node dialing, a "
            "non-loopback address); else that refuses to start");
  v.path("tls_ca", s.tls_ca,
         "the run's CA certificate (`spes-engine certs`): TLS 1.3 with node certificates on every connection; \"\" "
         "= off");
  v.path("tls_cert", s.tls_cert,
         "this process's certificate (needs `tls_ca`); \"\" = `coordinator.crt` (coordinator) or `node-<id>.crt` "
         "(node) beside `tls_ca`");
  v.path("tls_key", s.tls_key,
         "this process's key (needs `tls_ca`); \"\" = `coordinator.key` (coordinator) or `node-<id>.key` (node) "
         "beside `tls_ca`");
  v.real("round_timeout_s", s.round_timeout_s, open_closed(0, kInf),
         "close a round after this long with at least `min_nodes` nodes");
  v.integer("min_nodes", s.min_nodes, 1, 1 << 16, "the fewest nodes a round closes with, at most `n_nodes`");
  v.path("state_dir", s.state_dir,
         "where the coordinator keeps θ (`coordinator_state.bin`, written every round before it is published; "
         "`coordinator_state.bin.next` "
         "is the previous round's file, overwritten by the next round: twice the state's size on disk)");
  v.real("merge_alpha", s.merge_alpha, closed(0, 1),
         "expert-merging warm-up: α0 (0 = off); α0 > 0 needs `merge_interval` and `merge_decay_steps` > 0 ([README, "
         "Architecture: Sync round](../README.md#sync-round))");
  v.integer("merge_topk", s.merge_topk, 1, 4096, "expert-merging warm-up: donors per expert");
  v.integer("merge_interval", s.merge_interval, 0, kMaxInt,
            "expert-merging warm-up: merge at rounds whose step is a multiple of this");
  v.integer("merge_decay_steps", s.merge_decay_steps, 0, kMaxInt, "expert-merging warm-up: α reaches 0 at this step");
  v.choice("outer_optimizer", s.outer_optimizer, net::kOuterKindNames,
           "the coordinator's outer optimizer ([net/README.md, Outer optimizer](../net/README.md#outer-optimizer))");
  v.real("outer_lr", s.outer_lr, open_closed(0, 10), "outer learning rate; nesterov's default is 0.7");
  v.real("outer_momentum", s.outer_momentum, closed_open(0, 1),
         "outer momentum μ; nesterov only (an error with average), whose default is 0.9");
  v.real("update_bound", s.update_bound, closed_open(0, kInf),
         "coordinator: refuse a push whose update of a chunk (RMS of Δ) exceeds this × the median accepted update "
         "of its kind over the last `update_bound_rounds` rounds (0 = off; [net/README.md, What the coordinator "
         "guarantees](../net/README.md#what-the-coordinator-guarantees))");
  v.integer("update_bound_rounds", s.update_bound_rounds, 1, 1 << 16,
            "coordinator: rounds of accepted updates the bound's median looks at");
  v.integer("keep_rounds", s.keep_rounds, 2, 1 << 16,
            "coordinator: published rounds kept in `state_dir`/rounds, to restart from with `--rollback-to ROUND` "
            "(each a copy of the state file)");
  v.real("update_bound_first", s.update_bound_first, open_closed(0, kInf),
         "coordinator: the bound before any history, × the RMS of the chunk's θ");
}

template <class V, class C>
void checkpoint_keys(V& v, C& c) {
  v.path("dir", c.dir,
         "checkpoint root; each checkpoint is a `step-XXXXXXXX/` folder (in `node-N/` when n_nodes > 1)");
  v.integer("every", c.every, 0, kMaxInt, "steps between checkpoints (0 = only at the end)");
  v.integer("keep", c.keep, 1, 1 << 20, "newest checkpoints kept");
}

// The sections in file order.
template <class V, class C>
void config_sections(V& v, C& c) {
  v.section("model", [&] { model_keys(v, c.model); });
  v.section("train", [&] { train_keys(v, c.train); });
  v.section("optim", [&] { optim_keys(v, c.optim); });
  v.section("data", [&] { data_keys(v, c.data); });
  v.section("spes", [&] { spes_keys(v, c.spes); });
  v.section("checkpoint", [&] { checkpoint_keys(v, c.checkpoint); });
}

}  // namespace spes::config_keys
