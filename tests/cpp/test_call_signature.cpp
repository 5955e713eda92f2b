// The agreement of every compressed call (collectives/call_signature.h, exchanged by
// call_agreement.h) over ShmTransport between forked processes: every rank raises the same
// message naming the first field that differs, and the transport stays usable after a
// mismatch.
#include <cstdint>
#include <string>
#include <vector>

#include "check.h"
#include "collectives/call_agreement.h"
#include "fixtures.h"
#include "ranks.h"
#include "transport/shm_transport.h"

namespace cgx::test {
namespace {

using collectives::CallMismatchError;
using collectives::CallSignature;
using transport::ShmTransport;

// The message a call that moves nothing but its agreement throws, or "" when the ranks
// agree; `out_of_step` receives the error's flag.
std::string mismatch(ShmTransport& transport, int rank, int size, const CallSignature& mine,
                     collectives::Scratch& scratch, bool* out_of_step = nullptr) {
  try {
    collectives::AgreedCall(transport, rank, size, mine, 0, soon(), scratch).agree();
    return "";
  } catch (const CallMismatchError& e) {
    if (out_of_step) *out_of_step = e.out_of_step;
    return e.what();
  }
}

CGX_TEST(call_signatures_that_differ_raise_the_same_message_on_every_rank) {
  const int size = 3;
  run_ranks(size, [&](int rank, KeyValueStore& store, const std::string& prefix) {
    ShmTransport transport(rank, ranks_below(size), prefix, kRingBytes, store);
    collectives::Scratch scratch;
    const compression::LayoutCodec codec = mixed_layout();
    const compression::LayoutCodec other_plan = layout({quantized(codec.total(), 4, 512)});
    auto signature = [&](uint64_t sequence, const compression::LayoutCodec& plan, int32_t bits,
                         std::vector<int64_t> shape, double scale, uint64_t settings = 0x5e7) {
      return CallSignature(sequence, {shape}, codec.total(), plan, "Float", "SUM", bits, 512, settings, scale);
    };
    const std::vector<int64_t> shape{codec.total()};
    CHECK_EQ(mismatch(transport, rank, size, signature(7, codec, 4, shape, 1.0), scratch), std::string());

    // Rank 2 alone differs, in one field at a time; rank 0's view is named first.
    struct Case {
      CallSignature theirs;
      std::string expected;
      bool out_of_step;
    };
    const CallSignature same = signature(8, codec, 4, shape, 1.0);
    const std::vector<Case> cases = {
        {signature(9, codec, 4, shape, 1.0),
         "rank 0 has call #8 of the group, rank 2 has call #9 of the group", true},
        {signature(8, codec, 3, shape, 1.0), "rank 0 has 4 bits, rank 2 has 3 bits", false},
        {signature(8, other_plan, 4, shape, 1.0), "rank 0 has the per-layer plan 1000:4b/64", false},
        {signature(8, codec, 4, {1, codec.total()}, 1.0),
         "rank 0 has tensors of shapes [" + std::to_string(codec.total()) + "], rank 2 has tensors of shapes [1, ",
         false},
        {signature(8, codec, 4, shape, 0.5), "rank 0 has scale 1, rank 2 has scale 0.5", false},
        {signature(8, codec, 4, shape, 1.0, 0xab),
         "rank 0 has settings digest 0x00000000000005e7, rank 2 has settings digest 0x00000000000000ab", false},
    };
    for (const Case& c : cases) {
      bool out_of_step = !c.out_of_step;
      const std::string message = mismatch(transport, rank, size, rank == 2 ? c.theirs : same, scratch, &out_of_step);
      if (message.find("cgx: ranks were given different calls: " + c.expected) != 0)
        fail(__FILE__, __LINE__, "rank " + std::to_string(rank) + ": " + message);
      CHECK_EQ(out_of_step, c.out_of_step);
    }
    // Rank 1 given other arguments, rank 2 a call ahead: the group is out of step, whatever
    // rank 1's difference (named first, it would leave the group usable and pair the
    // others' next calls with rank 2's stale one).
    {
      bool out_of_step = false;
      const CallSignature mine = rank == 1 ? signature(8, codec, 3, shape, 1.0)
                                 : rank == 2 ? signature(9, codec, 4, shape, 1.0) : same;
      const std::string message = mismatch(transport, rank, size, mine, scratch, &out_of_step);
      CHECK(message.find("rank 0 has call #8 of the group, rank 2 has call #9 of the group") != std::string::npos);
      CHECK(out_of_step);
    }
    // Only signatures moved: the next call agrees.
    CHECK_EQ(mismatch(transport, rank, size, signature(10, codec, 4, shape, 1.0), scratch), std::string());
  });
}

CGX_TEST(call_signature_texts_are_cut_to_fit_and_hashes_still_tell_them_apart) {
  const compression::LayoutCodec codec = layout({quantized(10, 4, 512)});
  std::vector<std::vector<int64_t>> many(20, std::vector<int64_t>{123456});
  const CallSignature a(1, many, 10, codec, "Float", "SUM", 4, 512, 0);
  many.back() = {654321};
  const CallSignature b(1, many, 10, codec, "Float", "SUM", 4, 512, 0);
  const std::string text = a.shapes_text;
  CHECK_EQ(text.size(), sizeof a.shapes_text - 1);
  CHECK_EQ(text.substr(text.size() - 3), std::string("..."));
  CHECK_EQ(text, std::string(b.shapes_text));  // the difference is past the shown part
  CHECK(a.shapes != b.shapes);
}

}  // namespace
}  // namespace cgx::test
