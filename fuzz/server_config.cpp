// The YAML config of `kvserve serve`, rollout rules included: a validated ServerConfig or a
// ConfigError listing every problem with file, line and key. A config that validates is then asked
// for rollout decisions, which must name a policy the config defines (or the request's own, when
// an override is honoured).
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz/fuzz_common.h"
#include "configs/rollout.h"
#include "configs/server_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string text(reinterpret_cast<const char*>(data), size);
  kvfuzz::expect_only<kvserve::config::ConfigError>([&] {
    const auto c = kvserve::config::parse_server_config(text, "fuzz.yaml");
    if (!c.policies.count(c.default_policy)) std::abort();
    (void)kvserve::config::engine_policies(c);
    kvserve::config::RequestFacts f;
    f.model = "m";
    f.headers = {{"x-tenant", "beta"}, {"x-user-id", "u1"}};
    f.endpoint = "chat";
    f.user = "alice";
    f.request_id = "chatcmpl-1";
    for (int64_t tokens : {int64_t{-1}, int64_t{0}, int64_t{4096}}) {
      for (const std::string requested : {"", "full", "nope"}) {
        f.prompt_tokens = tokens;
        f.requested_policy = requested;
        const auto d = kvserve::config::decide(c.rollout, f, c.default_policy);
        // An honoured override names the request's own policy (the service checks that one
        // exists and answers 400 otherwise); every other decision must name a defined policy.
        const bool ok = d.override_rejected ? d.policy.empty()
                        : d.rule == "override" ? d.policy == requested
                                               : c.policies.count(d.policy) > 0;
        if (!ok) {
          std::fprintf(stderr, "fuzz: decide() chose undefined policy '%s' (rule %s)\n", d.policy.c_str(), d.rule.c_str());
          std::abort();
        }
      }
    }
  });
  return 0;
}
