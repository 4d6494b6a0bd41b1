// The calibration's op-table phase: the non-GEMM kernels (rmsnorm, swiglu, router,
// (un)permute, cross entropy, rope and its tables, attention) over token counts and
// sequence lengths, less the held-out sizes, timed together and stored as the
// profile's op tables (rope's less what its tables and the bandwidth account for).
#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "moeflex/profile/calibrate_benches.h"
#include "moeflex/profile/calibrate_internal.h"

namespace moeflex::calibration {
namespace {

/// One op table under construction: jobs, their bytes, and an optional part of the
/// time that another model already accounts for (subtracted: the table keeps the rest).
struct TableSpec {
  std::string name;
  std::vector<Bytes> bytes;
  std::vector<Job> jobs;
  std::vector<std::function<Seconds(const CostModel&)>> known;  // empty or one per job
};

/// Removes the points of `t` whose size a held-out invocation of its op looks up.
void drop_held_out(TableSpec& t, const std::map<std::string, std::set<Bytes>>& held) {
  auto it = held.find(t.name);
  if (it == held.end()) return;
  TableSpec kept{t.name, {}, {}, {}};
  for (std::size_t i = 0; i < t.bytes.size(); ++i) {
    if (it->second.count(t.bytes[i])) continue;
    kept.bytes.push_back(t.bytes[i]);
    kept.jobs.push_back(std::move(t.jobs[i]));
    if (!t.known.empty()) kept.known.push_back(std::move(t.known[i]));
  }
  t = std::move(kept);
}

/// Stores the medians (minus the known parts, at least 0) as the op's table.
void store_table(HardwareProfile& p, const TableSpec& t, const CostModel* model) {
  std::vector<OpSample> pts;
  for (std::size_t i = 0; i < t.jobs.size(); ++i) {
    Seconds s = t.jobs[i].time;
    if (!t.known.empty()) s = std::max<Seconds>(0, s - t.known[i](*model));
    pts.push_back({t.bytes[i], s});
  }
  std::sort(pts.begin(), pts.end(), [](const OpSample& a, const OpSample& b) { return a.bytes < b.bytes; });
  std::vector<OpSample> merged;  // equal byte counts keep their mean
  for (std::size_t i = 0; i < pts.size();) {
    std::size_t j = i;
    Seconds sum = 0;
    while (j < pts.size() && pts[j].bytes == pts[i].bytes) sum += pts[j++].seconds;
    merged.push_back({pts[i].bytes, sum / double(j - i)});
    i = j;
  }
  p.op_tables[t.name] = std::move(merged);
}

std::vector<TableSpec> plain_op_tables(OpBench& b, const std::vector<std::int64_t>& tokens,
                                       const std::vector<std::int64_t>& ce_tokens) {
  std::vector<TableSpec> specs;
  auto add = [&](const char* name) -> TableSpec& {
    specs.push_back({name, {}, {}, {}});
    return specs.back();
  };
  const std::int64_t d = kHidden;
  {
    TableSpec& f = add(op_names::kRmsnormForward);
    for (std::int64_t n : tokens) f.bytes.push_back(op_bytes::rmsnorm_forward(n, d)), f.jobs.push_back({b.rmsnorm_forward(n, d)});
  }
  {
    TableSpec& f = add(op_names::kRmsnormBackward);
    for (std::int64_t n : tokens) f.bytes.push_back(op_bytes::rmsnorm_backward(n, d)), f.jobs.push_back({b.rmsnorm_backward(n, d)});
  }
  // SwiGLU over expert FFN rows (n*k/2 rows: two experts' worth of a uniform
  // routing); the smallest counts fall under the kernel's parallel threshold, as
  // small experts do.
  std::vector<std::int64_t> swiglu_rows = {16, 32, 64};
  for (std::int64_t n : tokens) swiglu_rows.push_back(n * kTopK / 2);
  std::sort(swiglu_rows.begin(), swiglu_rows.end());
  swiglu_rows.erase(std::unique(swiglu_rows.begin(), swiglu_rows.end()), swiglu_rows.end());
  {
    TableSpec& f = add(op_names::kSwigluForward);
    for (std::int64_t rows : swiglu_rows)
      f.bytes.push_back(op_bytes::swiglu_forward(rows * kExpertFfn)), f.jobs.push_back({b.swiglu_forward(rows * kExpertFfn)});
  }
  {
    TableSpec& f = add(op_names::kSwigluBackward);
    for (std::int64_t rows : swiglu_rows)
      f.bytes.push_back(op_bytes::swiglu_backward(rows * kExpertFfn)), f.jobs.push_back({b.swiglu_backward(rows * kExpertFfn)});
  }
  {
    TableSpec& f = add(op_names::kRouterForward);
    for (std::int64_t n : tokens)
      f.bytes.push_back(op_bytes::router_forward(n, kExperts, kTopK)), f.jobs.push_back({b.router_forward(n)});
  }
  {
    TableSpec& f = add(op_names::kRouterBackward);
    for (std::int64_t n : tokens)
      f.bytes.push_back(op_bytes::router_backward(n, kExperts, kTopK)), f.jobs.push_back({b.router_backward(n)});
  }
  const char* perm_names[] = {op_names::kPermuteForward, op_names::kPermuteBackward, op_names::kUnpermuteForward,
                              op_names::kUnpermuteBackward};
  for (int which = 0; which < 4; ++which) {
    TableSpec& f = add(perm_names[which]);
    for (std::int64_t n : tokens)
      f.bytes.push_back(op_bytes::permute(n, kTopK, d)), f.jobs.push_back({b.permutation(which, n, d)});
  }
  {
    TableSpec& f = add(op_names::kCrossEntropyForward);
    for (std::int64_t n : ce_tokens)
      f.bytes.push_back(op_bytes::cross_entropy(n, kVocab)), f.jobs.push_back({b.cross_entropy_forward(n, kVocab)});
  }
  {
    TableSpec& f = add(op_names::kCrossEntropyBackward);
    for (std::int64_t n : ce_tokens)
      f.bytes.push_back(op_bytes::cross_entropy(n, kVocab)), f.jobs.push_back({b.cross_entropy_backward(n, kVocab)});
  }
  return specs;
}

}  // namespace

void measure_ops(HardwareProfile& p, bool full, Seconds budget, std::vector<Job>* extra) {
  const std::vector<std::int64_t> tokens = full ? std::vector<std::int64_t>{64, 128, 256, 512, 1024, 2048, 4096, 8192}
                                                : std::vector<std::int64_t>{128, 512, 1024, 2048, 4096};
  const std::vector<std::int64_t> ce_tokens = full ? std::vector<std::int64_t>{64, 128, 256, 512, 1024, 2048}
                                                   : std::vector<std::int64_t>{128, 512, 1024, 2048};
  const std::vector<std::int64_t> batches = full ? std::vector<std::int64_t>{1, 2, 4, 8, 16, 32}
                                                 : std::vector<std::int64_t>{1, 4, 8, 16};
  const std::vector<std::int64_t> table_seqs = full ? std::vector<std::int64_t>{32, 64, 128, 256, 512}
                                                    : std::vector<std::int64_t>{64, 128, 256};
  const std::vector<std::int64_t> att_seqs = full ? std::vector<std::int64_t>{32, 48, 64, 96, 128, 192, 256, 384, 512}
                                                  : std::vector<std::int64_t>{64, 96, 128, 192, 256};
  const std::int64_t max_n = tokens.back(), max_b = batches.back();
  OpBench b(max_n, std::max(max_n * kTopK * kHidden, max_n * kTopK / 2 * kExpertFfn), ce_tokens.back() * kVocab);
  const std::int64_t S = kSeq, H = kHeads, hd = kHeadDim;
  AttentionBench att(std::max({max_b * S * H * hd, table_seqs.back() * hd, kAttentionTableBatch * att_seqs.back() * H * hd}));

  // Stage 1: tables that depend on nothing else, and rope's cos/sin tables (one head
  // of one sequence: the rotation itself is a small part, subtracted at bandwidth).
  std::vector<TableSpec> specs = plain_op_tables(b, tokens, ce_tokens);
  TableSpec rope_tables{op_names::kRopeTables, {}, {}, {}};
  for (std::int64_t s : table_seqs) {
    rope_tables.bytes.push_back(op_bytes::rope_tables(s, hd));
    rope_tables.jobs.push_back({att.rope(1, s, 1, hd)});
    rope_tables.known.push_back(
        [s, hd](const CostModel& m) { return double(op_bytes::rope(1, s, 1, hd)) / m.profile().memory_bandwidth; });
  }
  // Stage 2: what rope takes beyond its tables.
  TableSpec rope{op_names::kRope, {}, {}, {}};
  for (std::int64_t B : batches) {
    rope.bytes.push_back(op_bytes::rope(B, S, H, hd));
    rope.jobs.push_back({att.rope(B, S, H, hd)});
    rope.known.push_back([S, hd](const CostModel& m) { return m.op(op_names::kRopeTables, op_bytes::rope_tables(S, hd)); });
  }
  // Attention, whole, on kAttentionTableBatch sequences of the model's heads over
  // sequence lengths, stored per head: the kernel runs B x H independent heads (a
  // batch of one sequence would keep q, k and v in L2, which a micro-batch does not).
  TableSpec att_f{op_names::kAttentionForward, {}, {}, {}};
  TableSpec att_b{op_names::kAttentionBackward, {}, {}, {}};
  for (std::int64_t s : att_seqs) {
    att_f.bytes.push_back(op_bytes::attention_softmax_forward(1, s, 1));
    att_f.jobs.push_back({att.forward(kAttentionTableBatch, s, H, hd)});
    att_b.bytes.push_back(op_bytes::attention_softmax_forward(1, s, 1));
    att_b.jobs.push_back({att.backward(kAttentionTableBatch, s, H, hd)});
  }
  // The held-out sizes stay held out.
  const std::map<std::string, std::set<Bytes>> held = held_out_op_bytes();
  for (TableSpec* t : {&rope_tables, &rope, &att_f, &att_b}) drop_held_out(*t, held);
  for (TableSpec& t : specs) drop_held_out(t, held);

  // All tables' jobs are timed together, in one set of interleaved rounds.
  std::vector<TableSpec*> all;
  for (TableSpec& s : specs) all.push_back(&s);
  for (TableSpec* s : {&rope_tables, &rope, &att_f, &att_b}) all.push_back(s);
  std::vector<Job> jobs;
  std::vector<Series> series;
  for (TableSpec* t : all) {
    Series one;
    for (std::size_t i = 0; i < t->jobs.size(); ++i) {
      one.emplace_back(double(t->bytes[i]), jobs.size());
      jobs.push_back(t->jobs[i]);
    }
    series.push_back(std::move(one));
  }
  const std::size_t at = add_extra(jobs, extra);
  run_series(jobs, series, budget);
  take_extra(jobs, at, extra);
  std::size_t next = 0;
  for (TableSpec* t : all)
    for (Job& j : t->jobs) j.time = jobs[next++].time;

  for (const TableSpec& s : specs) store_table(p, s, nullptr);
  for (const TableSpec* t : {&att_f, &att_b}) {
    store_table(p, *t, nullptr);
    for (OpSample& pt : p.op_tables[t->name]) pt.seconds /= double(kAttentionTableBatch * H);
  }
  {
    const CostModel stage1(p);
    store_table(p, rope_tables, &stage1);
  }
  const CostModel stage2(p);
  store_table(p, rope, &stage2);
}

}  // namespace moeflex::calibration
