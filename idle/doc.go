// Package idle is the loop that applies the idle policy (package
// idlepolicy) to the provider's running targets: it probes their daemons
// for how long they have been idle, and powers them down or closes them as
// the policy asks. It also maps the policy's stages to the controller
// plane's power states, which idlepolicy cannot name without importing
// controller.
package idle
