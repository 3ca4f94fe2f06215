-- Argo CD health check for initium's MutationRule and ClusterMutationRule: install it as
-- resource.customizations.health.initium.dev_MutationRule and
-- resource.customizations.health.initium.dev_ClusterMutationRule (see argocd-cm.yaml here,
-- and "GitOps: Argo CD and Flux health" in docs/operations.md). It needs only Lua's base
-- library, so no useOpenLibs setting.
--
--   Healthy      Ready=True for the current generation: the rule is in the index
--   Progressing  no status yet, a generation initium has not read yet, or Ready=False while
--                the rule waits for its kind to be served (a CRD not installed yet)
--   Degraded     Stalled=True: the rule does not compile (InvalidRule) or matches only kinds
--                initium never intercepts (KindNotAllowed); only a change to the rule helps
local hs = {status = "Progressing", message = "Waiting for initium to read the rule"}
if obj.status == nil or obj.status.conditions == nil then
  return hs
end
local generation = obj.metadata.generation
if generation ~= nil and obj.status.observedGeneration ~= generation then
  hs.message = "Waiting for initium to read generation " .. tostring(generation)
  return hs
end
local ready = nil
for _, condition in ipairs(obj.status.conditions) do
  if condition.type == "Stalled" and condition.status == "True" then
    hs.status = "Degraded"
    hs.message = tostring(condition.reason) .. ": " .. tostring(condition.message)
    return hs
  end
  if condition.type == "Ready" then
    ready = condition
  end
end
if ready == nil then
  return hs
end
if ready.status == "True" then
  hs.status = "Healthy"
elseif ready.reason == "InvalidRule" or ready.reason == "KindNotAllowed" then
  -- Written by an initium from before the Stalled condition.
  hs.status = "Degraded"
end
hs.message = tostring(ready.reason) .. ": " .. tostring(ready.message)
return hs
