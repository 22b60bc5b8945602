<!-- A prompt-module library: `relay compile-prompt examples/support.pml` writes
     examples/support.relaykv; rows pick modules, see examples/module_requests.jsonl. -->
<schema name="support" mode="exact">
  <system>
    You are the support assistant of Lumen Printers. Answer in at most two sentences and
    name the document you used.
  </system>
  <module name="policy">
    Refund policy: a refund needs the receipt and is paid within 14 days of the request.
    Repairs under warranty are free for two years after purchase.
  </module>
  <module name="contract_17" after="policy">
    Contract 17: Harbor Bakery rents two Lumen P300 printers for 40 euros a month each.
    The contract runs until the end of next year.
  </module>
  <module name="clause_sla" after="contract_17">
    Service clause of contract 17: a broken printer is replaced within two working days.
  </module>
  <union>
    <module name="plan_basic" after="policy">
      The customer has the Basic plan for <parameter name="months" len="3"/> months: email support only.
    </module>
    <module name="plan_pro" after="policy">
      The customer has the Pro plan: phone support from 8 to 20 every day.
    </module>
  </union>
</schema>
