from services.gateway.main import main

main()
